"""OpenAI's presence and frequency penalties, ``logit_bias``, vLLM's ``repetition_penalty`` and
JSON mode / JSON schemas: the target's logits adjusted by what came before a token is picked.

Owns: :class:`Penalties` (the settings, part of ``SamplingParams``), :class:`Generated` (how
often each id was generated so far: the only history they read) and :func:`adjusted` (one row
[V] adjusted for one history). Every loop picks from :func:`adjusted` rows -- plain decoding at
each step, verification at each visited node with the node's own history (the counts so far plus
the drafted tokens on its path, ``verify.py``), the batch for each member -- so greedy output
and the sampled distribution are the same whichever method serves a request. Knows token ids
only.

The rule, in this order: for each id j in the prompt or generated so far, the repetition
penalty r divides a positive logit by r and multiplies a negative one by r (vLLM's and
transformers' ``repetition_penalty``, from CTRL); for each id j generated c_j > 0 times so far
(the prompt does not count), ``logit_j -= frequency * c_j + presence`` (OpenAI's); then
``logit_j += bias_j`` for the ids ``logit_bias`` names; then, in JSON mode or under a JSON
schema, every token that would leave the grammar gets -inf (``json_grammar.py``). Temperature,
top-k and top-p then act on the adjusted logits. Reported logprobs stay the raw model's (``logprobs.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from evospec.decoding.json_grammar import JsonGrammar, JsonState

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's bounds for presence and frequency penalties
BIAS_RANGE = (-100.0, 100.0)  # and for a logit_bias value
# repetition_penalty's bounds: vLLM's (0, 2], the low end raised so that no logit divided by it
# overflows float32 (a penalty of 1e-300 turned every seen logit into inf and the row into NaN)
REPETITION_RANGE = (0.01, 2.0)


@dataclass(frozen=True)
class Penalties:
    """``bias``: (token id, value) pairs, ids distinct."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()
    repetition: float = 1.0  # 1: off
    # JSON mode / a JSON schema: tokens that would leave it get -inf (json_grammar.py)
    grammar: JsonGrammar | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        lo, hi = PENALTY_RANGE
        for name, v in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {v}")
        ids = [i for i, _ in self.bias]
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise ValueError("logit_bias needs distinct non-negative token ids")
        if any(not BIAS_RANGE[0] <= v <= BIAS_RANGE[1] for _, v in self.bias):
            raise ValueError(f"logit_bias values must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}]")
        lo, hi = REPETITION_RANGE
        if not lo <= self.repetition <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition}")

    @property
    def active(self) -> bool:
        """Whether any logit moves (all zero: rows are picked from as the model gives them)."""
        return bool(self.history or any(v for _, v in self.bias))

    @property
    def history(self) -> bool:
        """Whether the adjustment depends on what came before (not only ``logit_bias``)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.grammar)

    def start(self, prompt: Sequence[int], emitted: Sequence[int] = ()) -> Generated | None:
        """The history a loop keeps for a request with ``prompt`` that has already emitted
        ``emitted`` (a handed-over one); None where nothing reads it."""
        if not self.history:
            return None
        return Generated(emitted, prompt[: len(prompt) - len(emitted)], self.grammar)


class Generated:
    """How often each id was generated so far (a request's output), the ids of its prompt
    (which only the repetition penalty reads), and where the output stands in the JSON grammar
    (``state``, with a ``grammar``)."""

    def __init__(
        self, tokens: Iterable[int] = (), prompt: Iterable[int] = (), grammar: JsonGrammar | None = None
    ) -> None:
        tokens = list(tokens)
        self.counts: Counter[int] = Counter(tokens)
        self.prompt: frozenset[int] = frozenset(prompt)
        self.grammar = grammar
        self.state: JsonState | None = grammar.advance(grammar.start(), tokens) if grammar else None

    def add(self, tokens: Iterable[int]) -> None:
        tokens = list(tokens)
        self.counts.update(tokens)
        if self.grammar is not None:
            self.state = self.grammar.advance(self.state, tokens)

    def plus(self, tokens: Iterable[int]) -> Generated:
        """A copy with ``tokens`` added (a drafted path's history), this one unchanged."""
        tokens = list(tokens)
        out = Generated(grammar=None)
        out.counts, out.prompt, out.grammar = self.counts + Counter(tokens), self.prompt, self.grammar
        out.state = self.grammar.advance(self.state, tokens) if self.grammar is not None else None
        return out


def adjusted(row: torch.Tensor, penalties: Penalties, generated: Generated | None) -> torch.Tensor:
    """``row`` [V] logits -> a new [V] float32 row adjusted by ``penalties`` for ``generated``
    (the input is returned as it is where nothing moves)."""
    if not penalties.active:
        return row
    repeat = (
        penalties.repetition != 1.0 and generated is not None and bool(generated.counts or generated.prompt)
    )
    count = (
        bool(penalties.presence or penalties.frequency) and generated is not None and bool(generated.counts)
    )
    moves = repeat or count or bool(penalties.bias)
    out = row.float().clone() if moves else row.float()
    if repeat:
        ids = torch.tensor(
            sorted(generated.prompt.union(generated.counts)), dtype=torch.long, device=out.device
        )
        seen = out[ids]
        out[ids] = torch.where(seen > 0, seen / penalties.repetition, seen * penalties.repetition)
    if count:
        ids = torch.tensor(list(generated.counts), dtype=torch.long, device=out.device)
        counts = torch.tensor(list(generated.counts.values()), dtype=torch.float32, device=out.device)
        out.index_add_(0, ids, -(penalties.frequency * counts + penalties.presence))
    if penalties.bias:
        ids = torch.tensor([i for i, _ in penalties.bias], dtype=torch.long, device=out.device)
        out.index_add_(0, ids, torch.tensor([v for _, v in penalties.bias], device=out.device))
    if penalties.grammar is not None:
        grammar = penalties.grammar
        state = generated.state if generated is not None and generated.state is not None else grammar.start()
        blocked = grammar.blocked(state).to(out.device)
        out = out.masked_fill_(blocked, float("-inf")) if moves else out.masked_fill(blocked, float("-inf"))
    return out

"""OpenAI's presence and frequency penalties, ``logit_bias`` and vLLM's ``repetition_penalty``:
the target's logits adjusted by what came before a token is picked.

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
``logit_j += bias_j`` for the ids ``logit_bias`` names. Temperature, top-k and top-p then act on
the adjusted logits. Reported logprobs stay the raw model's (``logprobs.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

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
        return bool(self.presence or self.frequency or self.repetition != 1.0)


class Generated:
    """How often each id was generated so far (a request's output), and the ids of its prompt
    (which only the repetition penalty reads)."""

    def __init__(self, tokens: Iterable[int] = (), prompt: Iterable[int] = ()) -> None:
        self.counts: Counter[int] = Counter(tokens)
        self.prompt: frozenset[int] = frozenset(prompt)

    def add(self, tokens: Iterable[int]) -> None:
        self.counts.update(tokens)

    def plus(self, tokens: Iterable[int]) -> Generated:
        """A copy with ``tokens`` added (a drafted path's history), this one unchanged."""
        out = Generated()
        out.counts, out.prompt = self.counts + Counter(tokens), self.prompt
        return out


def adjusted(row: torch.Tensor, penalties: Penalties, generated: Generated | None) -> torch.Tensor:
    """``row`` [V] logits -> a new [V] float32 row adjusted by ``penalties`` for ``generated``
    (the input is returned as it is where nothing moves)."""
    if not penalties.active:
        return row
    out = row.float().clone()
    if penalties.repetition != 1.0 and generated is not None and (generated.counts or generated.prompt):
        ids = torch.tensor(
            sorted(generated.prompt.union(generated.counts)), dtype=torch.long, device=out.device
        )
        seen = out[ids]
        out[ids] = torch.where(seen > 0, seen / penalties.repetition, seen * penalties.repetition)
    if (penalties.presence or penalties.frequency) and generated is not None and generated.counts:
        ids = torch.tensor(list(generated.counts), dtype=torch.long, device=out.device)
        counts = torch.tensor(list(generated.counts.values()), dtype=torch.float32, device=out.device)
        out.index_add_(0, ids, -(penalties.frequency * counts + penalties.presence))
    if penalties.bias:
        ids = torch.tensor([i for i, _ in penalties.bias], dtype=torch.long, device=out.device)
        out.index_add_(0, ids, torch.tensor([v for _, v in penalties.bias], device=out.device))
    return out

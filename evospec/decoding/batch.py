"""Plain decoding of several requests at once: every sequence advances one token per step, all
of them in one forward (continuous batching: sequences join and leave between steps), and a
joining prompt is prefilled in chunks between the steps, so running streams keep flowing.

Owns: :class:`DecodeBatch` -- its members (:class:`Member`: a request's own KV cache, sampling
state, stop rule, the prompt tokens it has yet to prefill and the token it feeds next) --
:meth:`DecodeBatch.join` (a new request, or one a decoder began, taken over from the slots its
cache already holds), :meth:`DecodeBatch.advance` (one prefill chunk of the first member that
has one, then one :func:`~evospec.models.batch_step.step_sequences` forward for every member
whose prompt is in) and :meth:`DecodeBatch.leave` (which hands back the member, e.g. for its
cache's slots). Knows token ids and opaque member keys only.

Lossless: a member's tokens are what :func:`~evospec.decoding.autoregressive.generate_ar` gives
for its request alone -- a prompt's chunks and its last token (fed as a batched row, whose logits
pick the first new token) write the K/V and give the logits one prefill does (every forward of
these models is row-exact, ``decoding/prefix.py``), every batched row is bitwise that
sequence's own one-token step (``models/batch_step.py``), and tokens are picked by the same
:func:`~evospec.decoding.sampling.pick_token` from each member's own generator. Greedy output is
therefore identical to plain decoding whoever shares the batch (tests/decoding/test_batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from evospec.decoding.budget import Budget, cache_for, check_reuse, plan_budget
from evospec.decoding.events import StepEvent, StopRule
from evospec.decoding.logprobs import for_tokens
from evospec.decoding.penalties import Generated
from evospec.decoding.sampling import SamplingParams, derived_seed, pick_token
from evospec.models.batch_step import batched_steps_apply, step_sequences
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer

PREFILL_CHUNK = 128  # prompt tokens a joining request prefills between two steps (~0.2 s on 2 cores)


@dataclass
class Member:
    """One request in the batch."""

    key: Hashable
    cache: KVCache  # its own: the K/V of every token fed so far
    params: SamplingParams
    gen: torch.Generator
    rule: StopRule
    produced: int  # tokens emitted so far (counting any a decoder emitted before it joined)
    pending: int  # the token the next step feeds: the prompt's last, then each emitted one
    todo: list[int]  # prompt tokens to prefill before ``pending`` (chunk by chunk)
    cached: int  # prompt tokens whose slots it joined with (reported on its prefill event)
    prefill_s: float = 0.0  # its chunks' time so far
    first: bool = True  # its next event is the prefill event (not for a handed-over request)
    generated: Generated | None = None  # its output so far, where its penalties count it

    @property
    def ready(self) -> bool:
        """Its prompt is in: it steps with the batch."""
        return not self.todo


class DecodeBatch:
    """Members decoded together, at most ``capacity`` of them (``capacity`` >= 1); prompts
    prefill ``chunk`` tokens at a time between steps."""

    def __init__(
        self, model: Transformer, eos_ids: Sequence[int] = (), capacity: int = 4, chunk: int = PREFILL_CHUNK
    ) -> None:
        if capacity < 1 or chunk < 1:
            raise ValueError(f"capacity and chunk must be >= 1, got {capacity} and {chunk}")
        if not batched_steps_apply(model):
            raise ValueError("this model cannot step several sequences in one forward (models/batch_step.py)")
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.capacity = capacity
        self.chunk = chunk
        self.members: dict[Hashable, Member] = {}  # in joining order
        self.finished: dict[Hashable, Member] = {}  # ended by their last step, until left

    def __len__(self) -> int:
        return len(self.members)

    @property
    def full(self) -> bool:
        return len(self.members) >= self.capacity

    def budget(self, prompt_len: int, params: SamplingParams) -> Budget:
        """What plain decoding of this request may produce and needs (``plan_budget``)."""
        return plan_budget(self.model, prompt_len, params, eos_ids=self.eos_ids)

    def join(
        self,
        key: Hashable,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        cache: KVCache | None = None,
        reuse: int = 0,
        emitted: Sequence[int] = (),
        budget: Budget | None = None,
    ) -> None:
        """Add a member that will prefill ``prompt`` (its first ``reuse`` slots already in
        ``cache``) chunk by chunk and then step with the batch; its first event comes from
        :meth:`advance`. ``emitted``: tokens a decoder already produced for this request, alone
        (the handover: ``prompt`` then ends with them and ``cache`` holds all but the last of
        them, which the next step feeds; the budget, stop rule and count are the original
        request's -- ``budget`` by its original prompt's length, default ``prompt`` less
        ``emitted``)."""
        if key in self.members or key in self.finished:
            raise ValueError(f"{key!r} is already in the batch")
        if self.full:
            raise ValueError(f"the batch is full ({self.capacity} members)")
        prompt = list(prompt)
        budget = budget or self.budget(len(prompt) - len(emitted), params)
        check_reuse(cache, reuse, len(prompt))
        cache = cache_for(self.model, cache, budget.slots, keep=reuse)
        # a handed-over request draws from a stream of its own (seed and count), never
        # re-reading the uniforms its first tokens were drawn with
        gen = params.make_generator(self.model.device)
        if emitted and params.seed is not None:
            gen.manual_seed(derived_seed(params.seed, len(emitted)))
        todo, last = prompt[reuse:-1], prompt[-1]  # the prompt's last token is fed by a step
        member = Member(key, cache, params, gen, budget.rule, len(emitted), last, todo, reuse)
        member.first = not emitted  # a handed-over request had its prefill event alone
        member.generated = params.penalties.start(prompt, emitted)  # its output so far
        self.members[key] = member

    @torch.inference_mode()
    def advance(self) -> list[tuple[Hashable, StepEvent]]:
        """One prefill chunk of the first member that has prompt left, then one step of every
        member whose prompt is in. Returns (key, event) in joining order -- a member's first
        event is its prefill event -- and [] when nobody was ready to step; members whose token
        ends them stop stepping (kept in :attr:`finished` until :meth:`leave`)."""
        self._prefill_chunk()
        members = [m for m in self.members.values() if m.ready]
        if not members:
            return []
        t0 = time.perf_counter()
        feed, caches = [m.pending for m in members], [m.cache for m in members]
        logits = step_sequences(self.model, feed, caches)  # [B, V]
        picked = [pick_token(logits[i], m.params, m.gen, m.generated) for i, m in enumerate(members)]
        dt = time.perf_counter() - t0
        events = []
        for i, (m, tok) in enumerate(zip(members, picked, strict=True)):
            new, reason = m.rule.clip([tok], m.produced)
            m.produced += len(new)
            m.pending = tok
            if m.generated is not None:
                m.generated.add(new)
            if reason is not None:
                self.finished[m.key] = self.members.pop(m.key)
            lp = for_tokens(m.params.logprobs, logits[i : i + 1], new)
            ev = StepEvent(tokens=new, verify_s=dt, finish_reason=reason, logprobs=lp)
            if m.first:  # the prefill event: the prompt's chunks and its last token's row
                ev = replace(ev, verify_s=m.prefill_s + dt, prefill=True, cached_tokens=m.cached)
                m.first = False
            events.append((m.key, ev))
        return events

    def _prefill_chunk(self) -> None:
        """Up to ``chunk`` of the first waiting prompt's tokens into its cache (no logits: its
        last token is fed by a step)."""
        m = next((m for m in self.members.values() if m.todo), None)
        if m is None:
            return
        t0 = time.perf_counter()
        part, m.todo = m.todo[: self.chunk], m.todo[self.chunk :]
        start = m.cache.length
        device = self.model.device
        positions = torch.arange(start, start + len(part), device=device)
        self.model(torch.tensor([part], device=device), positions, m.cache, logits="none")
        m.prefill_s += time.perf_counter() - t0

    def leave(self, key: Hashable) -> Member | None:
        """Drop a member between steps (finished, cancelled, timed out) and return it: its
        cache holds its prompt and emitted tokens but the last. Unknown keys: None."""
        return self.members.pop(key, None) or self.finished.pop(key, None)

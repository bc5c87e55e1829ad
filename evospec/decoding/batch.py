"""Plain decoding of several requests at once: every sequence advances one token per step, all
of them in one forward (continuous batching: sequences join and leave between steps).

Owns: :class:`DecodeBatch` -- its members (:class:`Member`: a request's own KV cache, sampling
state, stop rule and the token it feeds next), :meth:`DecodeBatch.join` (prefill a new request,
or take over one a decoder started, from the slots its cache already holds), :meth:`DecodeBatch.step`
(one :func:`~evospec.models.batch_step.step_sequences` forward for all members) and
:meth:`DecodeBatch.leave` (which hands back the member, e.g. for its cache's slots). Knows token
ids and opaque member keys only.

Lossless: a member's tokens are what :func:`~evospec.decoding.autoregressive.generate_ar` gives
for its request alone -- the prefill is the same forward, every batched row is bitwise that
sequence's own one-token step (``models/batch_step.py``), and tokens are picked by the same
:func:`~evospec.decoding.sampling.pick_token` from each member's own generator. Greedy output is
therefore identical to plain decoding whoever shares the batch (tests/decoding/test_batch.py).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from evospec.decoding.budget import Budget, cache_for, check_reuse, plan_budget
from evospec.decoding.events import StepEvent, StopRule
from evospec.decoding.sampling import SamplingParams, pick_token
from evospec.models.batch_step import batched_steps_apply, step_sequences
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer


@dataclass
class Member:
    """One request in the batch."""

    key: Hashable
    cache: KVCache  # its own: the prompt's and emitted tokens' K/V but the pending one's
    params: SamplingParams
    gen: torch.Generator
    rule: StopRule
    produced: int  # tokens emitted so far (counting any a decoder emitted before it joined)
    pending: int  # the last emitted token: fed by the next step


class DecodeBatch:
    """Members decoded together, at most ``capacity`` of them (``capacity`` >= 1)."""

    def __init__(self, model: Transformer, eos_ids: Sequence[int] = (), capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not batched_steps_apply(model):
            raise ValueError("this model cannot step several sequences in one forward (models/batch_step.py)")
        self.model = model
        self.eos_ids = tuple(eos_ids)
        self.capacity = capacity
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

    @torch.inference_mode()
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
    ) -> StepEvent:
        """Prefill ``prompt`` (its first ``reuse`` slots already in ``cache``) and return the
        event of the token it picks; the member then steps with the batch unless that event
        finished it (then it waits in :attr:`finished` for :meth:`leave`). ``emitted``: tokens
        a decoder already produced for this request, alone (the handover: ``prompt`` then ends
        with them and ``cache`` holds all but the last of them; the budget, stop rule and count
        are the original request's -- ``budget`` by its original prompt's length, default
        ``prompt`` less ``emitted``)."""
        if key in self.members or key in self.finished:
            raise ValueError(f"{key!r} is already in the batch")
        if self.full:
            raise ValueError(f"the batch is full ({self.capacity} members)")
        prompt = list(prompt)
        budget = budget or self.budget(len(prompt) - len(emitted), params)
        check_reuse(cache, reuse, len(prompt))
        cache = cache_for(self.model, cache, budget.slots, keep=reuse)
        device = self.model.embed_tokens.weight.device
        # a handed-over request draws from a stream of its own (seed and count), never
        # re-reading the uniforms its first tokens were drawn with
        gen = params.make_generator(device)
        if emitted and params.seed is not None:
            gen.manual_seed(hash((params.seed, len(emitted))) & 0x7FFF_FFFF_FFFF_FFFF)
        t0 = time.perf_counter()
        out = self.model(
            torch.tensor([prompt[reuse:]], device=device), torch.arange(reuse, len(prompt), device=device),
            cache, logits="last",
        )  # fmt: skip
        tok = pick_token(out.logits[0, -1], params, gen)
        dt = time.perf_counter() - t0
        new, reason = budget.rule.clip([tok], len(emitted))
        member = Member(key, cache, params, gen, budget.rule, len(emitted) + 1, tok)
        (self.members if reason is None else self.finished)[key] = member
        first = not emitted
        return StepEvent(
            tokens=new, verify_s=dt, finish_reason=reason, prefill=first, cached_tokens=reuse if first else 0
        )

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, StepEvent]]:
        """One token for every member, in one forward; members whose token ends them stop
        stepping (kept in :attr:`finished` until :meth:`leave`). Returns (key, event) in joining
        order; [] for an empty batch."""
        members = list(self.members.values())
        if not members:
            return []
        t0 = time.perf_counter()
        feed, caches = [m.pending for m in members], [m.cache for m in members]
        logits = step_sequences(self.model, feed, caches)  # [B, V]
        picked = [pick_token(logits[i], m.params, m.gen) for i, m in enumerate(members)]
        dt = time.perf_counter() - t0
        events = []
        for m, tok in zip(members, picked, strict=True):
            new, reason = m.rule.clip([tok], m.produced)
            m.produced += len(new)
            m.pending = tok
            if reason is not None:
                self.finished[m.key] = self.members.pop(m.key)
            events.append((m.key, StepEvent(tokens=new, verify_s=dt, finish_reason=reason)))
        return events

    def leave(self, key: Hashable) -> Member | None:
        """Drop a member between steps (finished, cancelled, timed out) and return it: its
        cache holds its prompt and emitted tokens but the last. Unknown keys: None."""
        return self.members.pop(key, None) or self.finished.pop(key, None)

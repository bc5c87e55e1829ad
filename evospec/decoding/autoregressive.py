"""Plain autoregressive decoding: the baseline every speculative method must reproduce.

Owns: prefill + one-token decode loop over an explicit KV cache, yielding one
:class:`StepEvent` per token. Knows token ids only (no tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from evospec.decoding.budget import Budget, cache_for, check_reuse, plan_budget
from evospec.decoding.events import StepEvent
from evospec.decoding.logprobs import for_tokens
from evospec.decoding.sampling import SamplingParams, pick_token
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer


@torch.inference_mode()
def generate_ar(
    model: Transformer,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int] = (),
    cache: KVCache | None = None,
    budget: Budget | None = None,
    reuse: int = 0,
) -> Iterator[StepEvent]:
    """Yield one event per generated token until a stop id or the length budget (``budget``:
    planned by the caller, else here). ``reuse``: the first slots of ``cache`` already hold
    the K/V of that many prompt tokens (``prefix.py``); the prefill runs on the rest."""
    budget = budget or plan_budget(model, len(prompt), params, eos_ids=eos_ids)
    check_reuse(cache, reuse, len(prompt))
    cache = cache_for(model, cache, budget.slots, keep=reuse)
    rule = budget.rule
    device = model.device
    gen = params.make_generator(device)
    tokens = torch.tensor([list(prompt[reuse:])], dtype=torch.long, device=device)
    positions = torch.arange(reuse, len(prompt), device=device)
    produced = 0
    generated = params.penalties.start(prompt)
    while True:
        t0 = time.perf_counter()
        out = model(tokens, positions, cache, logits="last")
        tok = pick_token(out.logits[0, -1], params, gen, generated)
        dt = time.perf_counter() - t0
        first = produced == 0
        new, reason = rule.clip([tok], produced)
        produced += len(new)
        yield StepEvent(
            tokens=new,
            verify_s=dt,
            finish_reason=reason,
            prefill=first,
            cached_tokens=reuse if first else 0,
            logprobs=for_tokens(params.logprobs, out.logits[0, -1:], new),
        )
        if reason is not None:
            return
        if generated is not None:
            generated.add(new)
        tokens = torch.tensor([[tok]], dtype=torch.long, device=device)
        positions = torch.tensor([cache.length], device=device)

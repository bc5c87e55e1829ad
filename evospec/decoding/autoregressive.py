"""Plain autoregressive decoding: the baseline every speculative method must reproduce.

Owns: prefill + one-token decode loop over an explicit KV cache, yielding one
:class:`StepEvent` per token. Knows token ids only (no tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from evospec.decoding.events import StepEvent, StopRule
from evospec.decoding.sampling import SamplingParams, pick_token
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer


def plan_budget(
    model: Transformer, prompt_len: int, params: SamplingParams, slack: int = 0
) -> tuple[int, int]:
    """(max_new_tokens clipped to the context window, cache slots needed incl. ``slack``).

    Raises ValueError when the prompt leaves no room for even one new token.
    """
    ctx = model.cfg.max_position_embeddings
    if prompt_len < 1:
        raise ValueError("prompt must contain at least one token")
    if prompt_len >= ctx:
        raise ValueError(f"prompt has {prompt_len} tokens; the context window is {ctx}")
    max_new = min(params.max_new_tokens, ctx - prompt_len)
    return max_new, prompt_len + max_new + slack


def stop_rule(
    model: Transformer, params: SamplingParams, max_new: int, eos_ids: Sequence[int] = ()
) -> StopRule:
    eos = () if params.ignore_eos else (tuple(eos_ids) or model.cfg.eos_token_ids)
    return StopRule(frozenset(eos) | params.stop_ids, max_new)


@torch.inference_mode()
def generate_ar(
    model: Transformer,
    prompt: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: Sequence[int] = (),
    cache: KVCache | None = None,
) -> Iterator[StepEvent]:
    """Yield one event per generated token until a stop id or the length budget."""
    max_new, slots = plan_budget(model, len(prompt), params)
    if cache is None or cache.max_len < slots:
        cache = model.new_cache(slots)
    cache.reset()
    rule = stop_rule(model, params, max_new, eos_ids)
    device = model.embed_tokens.weight.device
    gen = params.make_generator(device)
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    positions = torch.arange(len(prompt), device=device)
    produced = 0
    while True:
        t0 = time.perf_counter()
        out = model(tokens, positions, cache, logits="last")
        tok = pick_token(out.logits[0, -1], params, gen)
        dt = time.perf_counter() - t0
        first = produced == 0
        new, reason = rule.clip([tok], produced)
        produced += len(new)
        yield StepEvent(tokens=new, verify_s=dt, finish_reason=reason, prefill=first)
        if reason is not None:
            return
        tokens = torch.tensor([[tok]], dtype=torch.long, device=device)
        positions = torch.tensor([cache.length], device=device)

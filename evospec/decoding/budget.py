"""One request's budget: how many tokens it may produce, how many cache slots it needs, when it
stops -- computed once per request, by the decoder, and handed to the loop.

Owns: :class:`Budget` and :func:`plan_budget` (``max_new_tokens`` clipped to the context
window; slots = prompt + new tokens + the tree's ``slack``), the :class:`StopRule` of a request
(EOS / stop ids / length; ``ignore_eos`` drops EOS), and :func:`cache_for` (reuse a decoder's
KV cache, growing it when a request needs more, keeping a reused prefix). The HTTP layer validates a request's
``max_tokens`` against the context window before it is queued, with OpenAI's messages; what
reaches a decoder is already valid, and this module is the decoding side's one copy of the
arithmetic. Knows nothing about tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from evospec.decoding.events import StopRule
from evospec.decoding.sampling import SamplingParams
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer


@dataclass(frozen=True)
class Budget:
    max_new: int  # tokens this request may produce (params.max_new_tokens clipped to the window)
    slots: int  # target cache slots needed: prompt + max_new + slack
    rule: StopRule


def plan_budget(
    model: Transformer,
    prompt_len: int,
    params: SamplingParams,
    *,
    eos_ids: Sequence[int] = (),
    slack: int = 0,
) -> Budget:
    """The budget of a ``prompt_len``-token prompt; ValueError when it leaves no room for even one
    new token. ``eos_ids`` (default: the model's) end generation unless ``params.ignore_eos``."""
    ctx = model.cfg.max_position_embeddings
    if prompt_len < 1:
        raise ValueError("prompt must contain at least one token")
    if prompt_len >= ctx:
        raise ValueError(f"prompt has {prompt_len} tokens; the context window is {ctx}")
    max_new = min(params.max_new_tokens, ctx - prompt_len)
    return Budget(max_new, prompt_len + max_new + slack, stop_rule(model, params, max_new, eos_ids))


def stop_rule(
    model: Transformer, params: SamplingParams, max_new: int, eos_ids: Sequence[int] = ()
) -> StopRule:
    eos = () if params.ignore_eos else (tuple(eos_ids) or model.cfg.eos_token_ids)
    return StopRule(frozenset(eos) | params.stop_ids, max_new)


def cache_for(model: Transformer, cache: KVCache | None, slots: int, keep: int = 0) -> KVCache:
    """``cache`` when it holds ``slots``, else a new one that does, with its first ``keep``
    slots committed (copied over when the cache grows; prefix reuse) and nothing after."""
    if cache is None or cache.max_len < slots:
        grown = model.new_cache(slots)
        if keep:
            grown.k[:, :, :, :keep] = cache.k[:, :, :, :keep]
            grown.v[:, :, :, :keep] = cache.v[:, :, :, :keep]
        cache = grown
    cache.reset()
    cache.advance(keep)
    return cache


def check_reuse(cache: KVCache | None, reuse: int, prompt_len: int) -> None:
    """A loop told that ``reuse`` prompt slots are cached: they must be, and one prompt token
    must be left to prefill."""
    if reuse and (cache is None or cache.length < reuse or reuse >= prompt_len):
        have = 0 if cache is None else cache.length
        raise ValueError(
            f"cannot reuse {reuse} slots: the cache holds {have}, the prompt has {prompt_len} tokens"
        )

"""Batched generation by the target (greedy, or with a caller's sampler), for building
draft-training data.

Owns: continuous batching over one preallocated KV cache. Rows are right-aligned at a shared
cache length L; each row masks its own leading slots (``left_pad``) and counts positions from
its first real token, so every row computes exactly what plain greedy decoding computes for
its prompt (tests check this against ``generate_ar``). When enough rows have finished, new
prompts are prefilled together in a side cache and copied into those rows at slots
[L - len, L), so the batch stays full. When the cache has no room for another full answer,
the wave drains and a new one starts. Knows token ids only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from evospec.decoding.sampling import greedy_ids
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer

Pick = Callable[[torch.Tensor], torch.Tensor]  # next-token logits [R, V] -> token ids [R]


class Finished(NamedTuple):
    """One completed answer. ``features``: [len(prompt) + len(answer) - 1, D] fp16 (every
    position fed to the model); ``support``: the target's top-k ids [len(answer) - 1, K]
    (int32) and log-probabilities (float32, normalised over the whole vocabulary) at the fed
    answer positions, i.e. the distribution of each next answer token."""

    index: int
    answer: list[int]
    features: torch.Tensor | None
    support: tuple[torch.Tensor, torch.Tensor] | None


def _prefill_rows(
    model: Transformer,
    prompts: list[Sequence[int]],
    end: int,
    cache: KVCache,
    rows: list[int],
    pick: Pick,
    grouped: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Prefill ``prompts`` right-aligned to slot ``end`` of ``rows``. On a CPU one prompt per
    forward: a prompt's rows cost what a decode row costs, so padding prompts to a shared width
    would spend most of a wave's prefill on pad rows. ``grouped`` (accelerators, where a forward
    costs its kernel launches more than its rows): all prompts in one left-padded forward.

    Returns (next tokens [R], pads [R], per prompt its features [len, D]).
    """
    device = cache.k.device
    if grouped:
        return _prefill_grouped(model, prompts, end, cache, rows, pick)
    nxt, feats = [], []
    for p, row in zip(prompts, rows, strict=True):
        n = len(p)
        side = model.new_cache(n, batch=1)
        ids = torch.tensor([list(p)], device=device)  # [1, n]
        out = model(ids, torch.arange(n, device=device), side, logits="last")
        cache.k[:, row, :, end - n : end] = side.k[:, 0]
        cache.v[:, row, :, end - n : end] = side.v[:, 0]
        feats.append(out.hidden[0])
        nxt.append(pick(out.logits[:, -1])[0])
    pad = end - torch.tensor([len(p) for p in prompts], device=device)
    return torch.stack(nxt), pad, feats


def _prefill_grouped(
    model: Transformer, prompts: list[Sequence[int]], end: int, cache: KVCache, rows: list[int], pick: Pick
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """:func:`_prefill_rows` in one forward: prompts left-padded to the longest (width w <= end)
    in a side cache, whose slots land at [end - w, end) of each row; a row's pad slots there
    lie before its own first slot, which its ``left_pad`` hides from then on."""
    device = cache.k.device
    width = max(len(p) for p in prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.tensor([[p[0]] * (width - len(p)) + list(p) for p in prompts], device=device)  # [R, w]
    side = model.new_cache(width, batch=len(prompts))
    out = model(ids, torch.arange(width, device=device), side, logits="last", left_pad=width - lens)
    idx = torch.tensor(rows, device=device)
    cache.k[:, idx, :, end - width : end] = side.k
    cache.v[:, idx, :, end - width : end] = side.v
    feats = [out.hidden[i, width - len(p) :] for i, p in enumerate(prompts)]
    return pick(out.logits[:, -1]), end - lens, feats


@torch.inference_mode()
def greedy_stream(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    *,
    batch_size: int = 16,
    cache_len: int = 2048,
    refill_at: int | None = None,
    features: bool = False,
    support_k: int = 0,
    pick: Pick = greedy_ids,
    grouped_prefill: bool | None = None,
) -> Iterator[Finished]:
    """Yield answers as they complete (EOS kept last), in completion order.

    With ``features``, each carries the target's final-layer features (post-norm, fp16) of
    every position that was fed to the model: the prompt and all answer tokens but the last --
    exactly what a teacher-forced forward gives, at no extra cost. With ``support_k`` > 0, also
    the target's top-k next-token ids and log-probabilities at the fed answer positions, taken
    from the logits the step computes anyway (the draft trainer's ``topk+neg`` loss needs them;
    a separate pass over the features would cost one LM-head product per token again).
    ``pick`` chooses each next token from the logits (default: greedy; a sampler makes the
    answers samples, e.g. for prompts the target writes itself). ``grouped_prefill`` (default:
    on a GPU) prefills each refill's prompts in one left-padded forward (``_prefill_grouped``).
    """
    device = model.device
    grouped = device.type == "cuda" if grouped_prefill is None else grouped_prefill
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new_tokens > cache_len:
        raise ValueError(
            f"cache_len {cache_len} cannot hold a {longest}-token prompt plus {max_new_tokens} tokens"
        )
    eos = set(eos_ids)
    support_k = min(support_k, model.cfg.vocab_size)
    refill_at = refill_at or max(1, batch_size // 4)
    queue = list(range(len(prompts)))[::-1]  # pop() takes the next prompt
    cache = model.new_cache(cache_len, batch=batch_size)
    while queue:
        # -- a new wave: prefill the first batch together ----------------------------------------
        first = [queue.pop() for _ in range(min(batch_size, len(queue)))]
        rows = list(range(len(first)))
        width = max(len(prompts[i]) for i in first)
        cache.reset()
        nxt = torch.zeros(batch_size, dtype=torch.long, device=device)
        pad = torch.full((batch_size,), width, dtype=torch.long, device=device)  # idle rows: all masked
        toks, pads, pf = _prefill_rows(model, [prompts[i] for i in first], width, cache, rows, pick, grouped)
        nxt[: len(first)], pad[: len(first)] = toks, pads
        cache.length = width
        owner: list[int | None] = [*first, *([None] * (batch_size - len(first)))]
        answers: list[list[int]] = [[] for _ in range(batch_size)]
        feats: list[list[torch.Tensor]] = [[f.half()] if features else [] for f in pf]
        feats += [[] for _ in range(batch_size - len(first))]
        sup: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(batch_size)]
        fresh = [r for r, o in enumerate(owner) if o is not None]  # rows whose nxt is unrecorded
        while True:
            step_tokens = nxt.tolist()
            for r in fresh:
                answers[r].append(step_tokens[r])
                if step_tokens[r] in eos or len(answers[r]) >= max_new_tokens:
                    yield Finished(
                        owner[r],
                        answers[r],
                        torch.cat(feats[r]) if features else None,
                        _stack(sup[r], support_k) if support_k else None,
                    )
                    owner[r], answers[r], feats[r], sup[r] = None, [], [], []
            free = [r for r, o in enumerate(owner) if o is None]
            room = cache.length + max_new_tokens < cache_len
            if queue and room and len(free) >= min(refill_at, len(queue)):
                take = [i for i in reversed(queue) if len(prompts[i]) <= cache.length][: len(free)]
                if take:
                    for i in take:
                        queue.remove(i)
                    rows = free[: len(take)]
                    toks, pads, pf = _prefill_rows(
                        model, [prompts[i] for i in take], cache.length, cache, rows, pick, grouped
                    )
                    idx = torch.tensor(rows, device=device)
                    nxt[idx], pad[idx] = toks, pads
                    for r, i, f in zip(rows, take, pf, strict=True):
                        owner[r] = i
                        feats[r] = [f.half()] if features else []
                    fresh = rows  # record the refilled rows' first tokens before decoding on
                    continue
            active = [r for r, o in enumerate(owner) if o is not None]
            if not active:
                break
            # idle rows decode a dummy token; their pad hides everything, their output is unused
            pos = torch.tensor([cache.length], device=device)
            out = model(nxt[:, None], pos, cache, logits="last", left_pad=pad)
            logits = out.logits[:, -1]  # [B, V]
            nxt = pick(logits)
            if features:
                step_feats = out.hidden[:, 0].half()  # [B, D] features of the tokens just fed
                for r in active:
                    feats[r].append(step_feats[r : r + 1])
            if support_k:
                top, ids = logits.float().topk(support_k, dim=-1)  # [B, K]
                logp = (top - torch.logsumexp(logits.float(), dim=-1, keepdim=True)).cpu()
                ids = ids.to("cpu", torch.int32)
                for r in active:
                    sup[r].append((ids[r : r + 1], logp[r : r + 1]))
            fresh = active


def _stack(rows: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not rows:  # a one-token answer: nothing was fed after the prompt
        return torch.zeros(0, k, dtype=torch.int32), torch.zeros(0, k)
    return torch.cat([i for i, _ in rows]), torch.cat([p for _, p in rows])


def greedy_batch(
    model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int], **kw
) -> list[list[int]]:
    """Greedy answers of all ``prompts``, in order."""
    out: list[list[int]] = [[] for _ in prompts]
    for done in greedy_stream(model, prompts, max_new_tokens, eos_ids, **kw):
        out[done.index] = done.answer
    return out

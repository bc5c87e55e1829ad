"""Log-probabilities of generated tokens under the target model, for the API's ``logprobs``.

Owns: :class:`TokenLogprob` (one generated token's log-probability and the most likely
alternatives at its position) and :func:`row_logprobs`, the one way they are computed from the
target's logits rows. Every decoding loop (plain, speculative, batched) calls it on the rows
its tokens were chosen from -- a decode step's, a verified node's -- so a request reports the
same values whichever method served it: the rows are the target's own (verified rows are
bitwise a one-token step's on the fused CPU path, ``decoding/prefix.py``). Knows token ids only.

What is reported: ``log_softmax`` of the raw logits, before temperature, top-k and top-p (what
OpenAI's and vLLM's default ``logprobs`` report), so a value does not depend on how a token was
picked. Cost, only when a request asks: ~0.13 ms a token for a 49,152-id row (its log-sum-exp),
~0.3 ms with 5-20 alternatives (a partition, a pass for ties at the edge; AMD EPYC, 2 cores;
scripts/logprobs_cost.py: whole decodes with 5 alternatives at 0.89-0.91x the tokens/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP_LOGPROBS = 20  # alternatives a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token at its position."""

    token: int
    logprob: float  # log p(token) under the target's raw distribution (-inf: probability 0)
    top: tuple[tuple[int, float], ...] = ()  # the most likely ids and their logprobs, best first


def row_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``rows`` [n, V] logits (row i: the distribution ``tokens[i]`` was chosen from), ``tokens``
    [n] -> one :class:`TokenLogprob` each, with the ``top`` most likely ids (0: none; equal
    values: the lower id first). A row with a NaN logit reports NaN."""
    if rows.dim() != 2 or rows.shape[0] != len(tokens):
        raise ValueError(f"expected {len(tokens)} rows of logits, got shape {tuple(rows.shape)}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
    host = rows.detach().float().cpu().numpy()
    return [_one(row, int(tok), top) for row, tok in zip(host, tokens, strict=True)]


def _one(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    m = row.max()
    if not np.isfinite(m):  # NaN (or every logit +-inf): no distribution to report
        return TokenLogprob(token, float("nan"), tuple((i, float("nan")) for i in range(top)))
    lse = float(m) + float(np.log(np.exp(row - m).sum(dtype=np.float64)))  # float32 exps, a float64 sum
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        vocab = row.shape[0]
        k = min(top, vocab)
        edge = row[np.argpartition(row, vocab - k)[vocab - k :]].min()
        ids = np.flatnonzero(row >= edge)  # ties at the edge: every one, lowest ids kept below
        order = np.lexsort((ids, -row[ids]))[:k]  # by value descending, then id ascending
        alternatives = tuple((int(ids[j]), float(row[ids[j]]) - lse) for j in order)
    return TokenLogprob(token, float(row[token]) - lse, alternatives)


def for_tokens(top: int | None, rows: torch.Tensor, tokens: Sequence[int]) -> list[TokenLogprob] | None:
    """What a loop puts in its event: None when the request did not ask (``top`` None), else
    :func:`row_logprobs` of ``tokens`` from the first ``len(tokens)`` of ``rows`` [>= n, V] (an
    event's tokens may be clipped at a stop)."""
    if top is None:
        return None
    return row_logprobs(rows[: len(tokens)], tokens, top)


PROMPT_CHUNK = 128  # prompt rows scored per forward: [128, V] float32 logits (~25 MB at 49,152 ids)


@torch.inference_mode()
def prompt_logprobs(model, prompt: Sequence[int], top: int, chunk: int = PROMPT_CHUNK) -> list[TokenLogprob]:
    """The logprob of each prompt token after the first under the target (``echo`` with
    ``logprobs``): one prefill of ``prompt`` into a cache of its own, ``chunk`` rows at a time,
    every row's logits kept -> [len(prompt) - 1] entries (token i + 1 from row i)."""
    ids = list(prompt)
    device = model.device
    cache = model.new_cache(len(ids))
    out: list[TokenLogprob] = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)  # rows [start, end) predict tokens [start + 1, end + 1)
        tokens = torch.tensor([ids[start:end]], dtype=torch.long, device=device)
        logits = model(tokens, torch.arange(start, end, device=device), cache, logits="all").logits[0]
        out += row_logprobs(logits, ids[start + 1 : end + 1], top)
    return out

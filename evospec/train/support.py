"""Affordable distillation losses for draft heads over huge vocabularies (Gemma-3: 262,144).

Owns: choosing the loss support for a vocabulary size, the target's top-k support of every
cached feature row (computed once, cached on disk), and the soft cross-entropy restricted to
that support plus sampled negatives. Knows nothing about the head's architecture, batching
or optimisation; see ``trainer.py``.

Why: the EAGLE recipe's soft cross-entropy needs the target's distribution and the head's
log-softmax over the whole vocabulary at every scored pair. With N pairs per batch, hidden
size D and vocabulary V that is three N x V x D products per step (target logits, head
logits, their gradient) and several N x V float tensors: for Gemma-3-270M (D 640, V 262k)
and N ~ 2k, about 2 TFLOP and 8+ GB per step, on a CPU.

The ``topk+neg`` loss instead keeps, per pair, the target's K most likely ids S (their
log-probabilities normalised over the full vocabulary, computed once per dataset) and M
negative ids drawn uniformly from the vocabulary, shared by the batch. The head's log
partition function is estimated from S plus the negatives, each negative standing for V / M
ids (its logit is shifted by log(V / M); negatives that fall into a row's S are masked), an
unbiased estimate of the sum over the ids outside S. The loss is

    -sum_{j in S} p_target(j) * (z_j - logsumexp(z_S, z_neg + log(V / M)))

which equals the full soft cross-entropy minus the target's tail beyond S (the top-32 mass
of a 270M model is typically above 0.9), and is exactly the full loss when S covers V.
Cost per step: N x (K + M) x D, about 200x less than the full softmax for K 32, M 1024.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm.auto import tqdm

LOSS_SUPPORTS = ("auto", "full", "data", "topk+neg")
LARGE_VOCAB = 128 * 1024  # from here on "auto" picks topk+neg
DEFAULT_K = 32
DEFAULT_NEGATIVES = 1024


def resolve_support(choice: str, vocab_size: int) -> str:
    """The concrete loss support for ``choice`` ("auto": topk+neg for V >= 128k, else data)."""
    if choice not in LOSS_SUPPORTS:
        raise ValueError(f"unknown loss support {choice!r}; choose from {LOSS_SUPPORTS}")
    if choice == "auto":
        return "topk+neg" if vocab_size >= LARGE_VOCAB else "data"
    return choice


@torch.no_grad()
def topk_support(
    features: torch.Tensor,  # [T, D] target features (any float dtype)
    lm_head: torch.Tensor,  # [V, D] the target's LM head
    k: int,
    *,
    rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` ids [T, k] (int32) and their log-probabilities [T, k] (float32).

    Log-probabilities are normalised over the whole vocabulary; rows are processed in chunks
    of ``rows`` so memory stays at rows x V floats.
    """
    t = features.shape[0]
    ids = torch.empty(t, k, dtype=torch.int32)
    logp = torch.empty(t, k, dtype=torch.float32)
    w = lm_head.float()
    for lo in range(0, t, rows):
        logits = features[lo : lo + rows].to(w.device).float() @ w.T  # [r, V] on the head's device
        top, idx = logits.topk(k, dim=-1)
        logp[lo : lo + rows] = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).cpu()
        ids[lo : lo + rows] = idx.to("cpu", torch.int32)
    return ids, logp


def dataset_supports(
    features: list[torch.Tensor],  # per sequence [T_s, D]
    lm_head: torch.Tensor,  # [V, D]
    k: int,
    cache: Path | None = None,
    *,
    progress: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``topk_support`` of every sequence, loaded from / saved to ``cache`` (safetensors).

    The cache is keyed by k, the vocabulary size and the per-sequence lengths; a mismatch
    recomputes it.
    """
    from safetensors.torch import load_file

    from evospec.common import save_tensors

    lengths = torch.tensor([f.shape[0] for f in features], dtype=torch.int64)
    key = torch.tensor([k, lm_head.shape[0]], dtype=torch.int64)
    if cache is not None and cache.is_file():
        d = load_file(str(cache))
        if torch.equal(d["key"], key) and torch.equal(d["lengths"], lengths):
            ids_all, logp_all = d["ids"], d["logp"]
            return list(zip(ids_all.split(lengths.tolist()), logp_all.split(lengths.tolist()), strict=True))
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = int(lengths.sum())
    with tqdm(total=total, desc=f"target top-{k}", unit="tok", disable=not progress) as bar:
        for f in features:
            out.append(topk_support(f, lm_head, k))
            bar.update(f.shape[0])
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp")
        save_tensors(
            {
                "key": key,
                "lengths": lengths,
                "ids": torch.cat([i for i, _ in out]),
                "logp": torch.cat([p for _, p in out]),
            },
            str(tmp),
        )
        tmp.rename(cache)
    return out


def sampled_soft_ce(
    out: torch.Tensor,  # [N, D] head outputs (requires grad)
    lm_head: torch.Tensor,  # [V, D] frozen
    support_ids: torch.Tensor,  # [N, K] int64 the target's top-k ids
    support_logp: torch.Tensor,  # [N, K] the target's log-probabilities of those ids
    negatives: torch.Tensor,  # [M] int64 ids drawn uniformly from [0, V) (M may be 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE on the target's support plus sampled negatives (see the module docstring).

    Returns (mean loss over the N rows, the head's argmax id per row [N] in target-id space,
    taken over the support and the negatives).
    """
    vocab = lm_head.shape[0]
    valid = support_logp > float("-inf")  # [N, K]; False: an entry ``restrict_support`` dropped
    z_s = torch.einsum("nd,nkd->nk", out, lm_head[support_ids])  # [N, K]
    parts = [z_s.masked_fill(~valid, float("-inf"))]
    if negatives.numel():
        z_n = out @ lm_head[negatives].T + math.log(vocab / negatives.numel())  # [N, M]
        clash = ((negatives[None, None, :] == support_ids[:, :, None]) & valid[:, :, None]).any(1)  # [N, M]
        parts.append(z_n.masked_fill(clash, float("-inf")))
    z = torch.cat(parts, dim=-1)  # [N, K + M]
    log_z = torch.logsumexp(z, dim=-1, keepdim=True)
    loss = -(support_logp.exp() * (z_s - log_z).masked_fill(~valid, 0.0)).sum(-1).mean()
    with torch.no_grad():
        cand = torch.cat([support_ids, negatives.expand(out.shape[0], -1)], dim=-1)  # [N, K + M]
        best = cand.gather(1, z.argmax(-1, keepdim=True)).squeeze(1)  # [N]
    return loss, best


def full_soft_ce(
    out: torch.Tensor,  # [N, D]
    tgt: torch.Tensor,  # [N, D] target features
    lm_head: torch.Tensor,  # [V', D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft CE over every row of ``lm_head`` (the reference the sampled loss approximates).

    Returns (mean loss, the head's argmax row index per pair [N]).
    """
    logits = out @ lm_head.T  # [N, V']
    with torch.no_grad():
        p_tgt = torch.softmax(tgt @ lm_head.T, dim=-1)
    loss = -(p_tgt * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    return loss, logits.detach().argmax(-1)


def restrict_support(
    support_ids: torch.Tensor,  # [N, K] int64 target ids
    support_logp: torch.Tensor,  # [N, K]
    in_draft: torch.Tensor,  # [V] bool: the target ids a reduced (d2t) draft vocabulary covers
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's support seen from a reduced draft vocabulary: ids become draft rows, entries
    outside the vocabulary are dropped (log-prob -inf, row 0), and each row's remaining mass is
    renormalised -- the target's distribution conditioned on the draft vocabulary, which is all
    a reduced head can put mass on. A row with no entry left has no loss."""
    slot = torch.cumsum(in_draft.long(), 0) - 1  # [V] draft row of each covered target id
    keep = in_draft[support_ids]  # [N, K]
    ids = torch.where(keep, slot[support_ids], torch.zeros_like(support_ids))
    logp = support_logp.masked_fill(~keep, float("-inf"))
    mass = torch.logsumexp(logp, dim=-1, keepdim=True)  # [N, 1]; -inf: nothing covered
    logp = torch.where(keep, logp - mass.clamp(min=-1e4), logp)
    return ids, logp

"""The draft forward along verified trajectories, batched, with autograd.

Owns: collating :class:`~evospec.adapt.trajectory.Trajectory` records into static padded
tensors (:class:`TrajectoryBatch`) and :func:`draft_support_logits`, which replays what the
drafter computed in the round -- the context pairs under a causal mask, then one chained
step per verified token, each step feeding the previous step's draft feature -- and returns
the draft's logits on every step's retained target support.

Shared prefixes: a request's trajectories share its context store (``trajectory.py``). The
collated batch holds one *span* per request (from the earliest window start to the latest
root) and each trajectory points at its span and its root's row. :func:`unroll` runs every
span once under a causal mask (with autograd: the adapter's q/v weights shape the context's
keys and values too), then the chained steps of all trajectories together, each attending to
its span up to its own root and to its own earlier steps. So the cost grows with the distinct
context rows of a batch, not with trajectories x context.

Differences from serving, on purpose: a span starts at most ``context`` pairs before its
earliest root (serving sees the whole request; positions are renumbered from the span's
start, and RoPE depends on offsets only, so a span is exact for what it contains), and the
draft's logits are taken on the target's retained support rather than the round's active
vocabulary. The cache used here concatenates instead of writing in place, so the graph stays
differentiable through every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evospec.adapt.trajectory import Trajectory
from evospec.models.eagle import EagleHead


@dataclass
class TrajectoryBatch:
    features: torch.Tensor  # [G, L] + [D] context spans (one per request), zero-padded on the right
    ctx_tokens: torch.Tensor  # [G, L]
    group: torch.Tensor  # [B] the span each trajectory reads
    ctx_end: torch.Tensor  # [B] one past its root pair's row in that span
    tokens: torch.Tensor  # [B, S] verified ids (0 past a trajectory's end)
    step_valid: torch.Tensor  # [B, S] bool
    support_ids: torch.Tensor  # [B, S, K]
    support_logits: torch.Tensor  # [B, S, K] float32
    target_index: torch.Tensor  # [B, S]
    in_vocab: torch.Tensor  # [B, S] bool
    rejected: torch.Tensor  # [B, S] bool

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def _spans(trajs: list[Trajectory]) -> list[tuple[Trajectory, int, int, list[int]]]:
    """Group by context store -> (holder of the newest store, span start, span end, members)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(trajs):
        groups.setdefault(("request", t.request) if t.request is not None else ("alone", i), []).append(i)
    out = []
    for members in groups.values():
        newest = max(members, key=lambda i: trajs[i].ctx_end)  # its store holds every row the rest need
        lo = min(trajs[i].ctx_start for i in members)
        out.append((trajs[newest], lo, trajs[newest].ctx_end, members))
    return out


def collate(trajs: list[Trajectory], device: torch.device | str = "cpu") -> TrajectoryBatch:
    """One span per request, steps padded to the longest path. Copies out of inference mode
    (worker-safe)."""
    b = len(trajs)
    spans = _spans(trajs)
    g, span_len = len(spans), max(hi - lo for _, lo, hi, _ in spans)
    s = max(t.steps for t in trajs)
    k = trajs[0].support_ids.shape[1]
    d = trajs[0].ctx_features.shape[1]
    with torch.inference_mode(False), torch.no_grad():
        out = TrajectoryBatch(
            features=torch.zeros(g, span_len, d, device=device),
            ctx_tokens=torch.zeros(g, span_len, dtype=torch.long, device=device),
            group=torch.zeros(b, dtype=torch.long, device=device),
            ctx_end=torch.zeros(b, dtype=torch.long, device=device),
            tokens=torch.zeros(b, s, dtype=torch.long, device=device),
            step_valid=torch.zeros(b, s, dtype=torch.bool, device=device),
            support_ids=torch.zeros(b, s, k, dtype=torch.long, device=device),
            support_logits=torch.zeros(b, s, k, device=device),
            target_index=torch.zeros(b, s, dtype=torch.long, device=device),
            in_vocab=torch.zeros(b, s, dtype=torch.bool, device=device),
            rejected=torch.zeros(b, s, dtype=torch.bool, device=device),
        )
        for gi, (holder, lo, hi, members) in enumerate(spans):
            out.features[gi, : hi - lo] = holder.ctx_features[lo:hi].float()
            out.ctx_tokens[gi, : hi - lo] = holder.ctx_tokens[lo:hi]
            for i in members:
                out.group[i], out.ctx_end[i] = gi, trajs[i].ctx_end - lo
        for i, t in enumerate(trajs):
            m = t.steps
            out.tokens[i, :m] = t.tokens
            out.step_valid[i, :m] = True
            out.support_ids[i, :m] = t.support_ids
            out.support_logits[i, :m] = t.support_logits.float()
            out.target_index[i, :m] = t.target_index
            out.in_vocab[i, :m] = t.in_vocab
            out.rejected[i, :m] = t.rejected
    return out


class GrowingCache:
    """A KV cache that concatenates (no in-place writes), for differentiable unrolls."""

    def __init__(self) -> None:
        self.length = 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self._k:
            k, v = torch.cat([self._k[layer], k], dim=2), torch.cat([self._v[layer], v], dim=2)
        self._k[layer], self._v[layer] = k, v
        return k, v

    def advance(self, n: int) -> None:
        self.length += n

    def select(self, rows: torch.Tensor) -> None:
        """Re-batch: row i of the cache becomes row ``rows[i]`` of the old one."""
        for layer in self._k:
            self._k[layer] = self._k[layer].index_select(0, rows)
            self._v[layer] = self._v[layer].index_select(0, rows)


def unroll(head: EagleHead, batch: TrajectoryBatch) -> torch.Tensor:
    """Draft features of every step: [B, S, D] (steps past a trajectory's end are garbage)."""
    span_len = batch.features.shape[1]
    s = batch.tokens.shape[1]
    device = batch.features.device
    cache = GrowingCache()
    causal = torch.ones(span_len, span_len, dtype=torch.bool, device=device).tril()  # [L, L]
    feats = batch.features.to(head.fc.weight.dtype)
    positions = torch.arange(span_len, device=device)
    out = head(feats, batch.ctx_tokens, positions, cache, causal[None, None])  # [G, L, D]
    steps = [out[batch.group, batch.ctx_end - 1]]  # step 1: each root pair's output, [B, D]
    cache.select(batch.group)  # [B, H_kv, L, Dh]: each trajectory's span
    seen = positions[None] < batch.ctx_end[:, None]  # [B, keys so far]: its span up to its root
    ones = torch.ones(batch.size, 1, dtype=torch.bool, device=device)
    for j in range(1, s):
        seen = torch.cat([seen, ones], dim=1)  # [B, L + j]
        pos = (batch.ctx_end - 1 + j)[:, None]  # [B, 1]
        h = head(steps[-1][:, None], batch.tokens[:, j - 1 : j], pos, cache, seen[:, None, None, :])
        steps.append(h[:, 0])
    return torch.stack(steps, dim=1)


def support_logits(hidden: torch.Tensor, lm_head: torch.Tensor, support_ids: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, D], lm_head [V, D], support_ids [B, S, K] -> draft logits [B, S, K].

    Projects onto the union of the batch's support rows once, then picks each row's K.
    """
    b, s, k = support_ids.shape
    uniq, inverse = torch.unique(support_ids, return_inverse=True)  # [U], [B, S, K]
    rows = lm_head.index_select(0, uniq).to(hidden.dtype)  # [U, D]
    logits = hidden.reshape(b * s, -1) @ rows.T  # [B*S, U]
    return logits.gather(1, inverse.reshape(b * s, k)).reshape(b, s, k)


def draft_support_logits(head: EagleHead, lm_head: torch.Tensor, batch: TrajectoryBatch) -> torch.Tensor:
    """[B, S, K] draft logits on each step's retained target support (through an EAGLE-3
    head's final norm, ``logit_input``; an EAGLE-2 head's output goes to the LM head as is)."""
    return support_logits(head.logit_input(unroll(head, batch)), lm_head, batch.support_ids)

"""The draft forward along verified trajectories, batched, with autograd.

Owns: collating :class:`~evospec.adapt.trajectory.Trajectory` records into static padded
tensors (:class:`TrajectoryBatch`) and :func:`draft_support_logits`, which replays what the
drafter computed in the round -- the context pairs under a causal mask, then one chained
step per verified token, each step feeding the previous step's draft feature -- and returns
the draft's logits on every step's retained target support.

Differences from serving, on purpose: attention sees only the last ``context`` committed
pairs (positions are renumbered from 0; RoPE depends on offsets only, so a window is exact
for what it contains), and the draft's logits are taken on the target's retained support
rather than the round's active vocabulary. The cache used here concatenates instead of
writing in place, so the graph stays differentiable through every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evospec.adapt.trajectory import Trajectory
from evospec.models.eagle import EagleHead


@dataclass
class TrajectoryBatch:
    features: torch.Tensor  # [B, C, D] context features, left-padded
    ctx_tokens: torch.Tensor  # [B, C]
    ctx_valid: torch.Tensor  # [B, C] bool
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


def collate(trajs: list[Trajectory], device: torch.device | str = "cpu") -> TrajectoryBatch:
    """Pad to the longest context / path. Clones out of inference mode (worker-safe)."""
    b = len(trajs)
    c = max(t.ctx_tokens.shape[0] for t in trajs)
    s = max(t.steps for t in trajs)
    k = trajs[0].support_ids.shape[1]
    d = trajs[0].ctx_features.shape[1]
    with torch.inference_mode(False), torch.no_grad():
        out = TrajectoryBatch(
            features=torch.zeros(b, c, d, device=device),
            ctx_tokens=torch.zeros(b, c, dtype=torch.long, device=device),
            ctx_valid=torch.zeros(b, c, dtype=torch.bool, device=device),
            tokens=torch.zeros(b, s, dtype=torch.long, device=device),
            step_valid=torch.zeros(b, s, dtype=torch.bool, device=device),
            support_ids=torch.zeros(b, s, k, dtype=torch.long, device=device),
            support_logits=torch.zeros(b, s, k, device=device),
            target_index=torch.zeros(b, s, dtype=torch.long, device=device),
            in_vocab=torch.zeros(b, s, dtype=torch.bool, device=device),
            rejected=torch.zeros(b, s, dtype=torch.bool, device=device),
        )
        for i, t in enumerate(trajs):
            n, m = t.ctx_tokens.shape[0], t.steps
            out.features[i, c - n :] = t.ctx_features.float()
            out.ctx_tokens[i, c - n :] = t.ctx_tokens
            out.ctx_valid[i, c - n :] = True
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


def unroll(head: EagleHead, batch: TrajectoryBatch) -> torch.Tensor:
    """Draft features of every step: [B, S, D] (steps past a trajectory's end are garbage)."""
    b, c, _ = batch.features.shape
    s = batch.tokens.shape[1]
    device = batch.features.device
    cache = GrowingCache()
    causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()  # [C, C]
    # a padded query row still sees itself, so no softmax row is empty
    eye = torch.eye(c, dtype=torch.bool, device=device)
    mask = (causal[None] & batch.ctx_valid[:, None, :]) | eye[None]  # [B, C, C]
    feats = batch.features.to(head.fc.weight.dtype)
    out = head(feats, batch.ctx_tokens, torch.arange(c, device=device), cache, mask[:, None])
    steps = [out[:, -1]]  # step 1: the root pair's output, [B, D]
    seen = batch.ctx_valid  # [B, keys so far]
    ones = torch.ones(b, 1, dtype=torch.bool, device=device)
    for j in range(1, s):
        seen = torch.cat([seen, ones], dim=1)  # [B, C + j]
        pos = torch.tensor([c - 1 + j], device=device)
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
    """[B, S, K] draft logits on each step's retained target support."""
    return support_logits(unroll(head, batch), lm_head, batch.support_ids)

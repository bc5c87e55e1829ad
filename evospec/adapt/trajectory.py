"""What one verified round teaches the draft: a :class:`Trajectory`, and the recorder that
builds it on the decode thread.

Owns: the per-request rolling context (the last ``context`` committed (feature, token) pairs,
exactly what the drafter committed) and, at the end of a round, the cheap snapshot the
worker needs to recompute the draft forward along the verified path: the context, the
verified tokens, the target's top-``K_logit`` logits at every step (the verified token is
always part of that support), and per step whether the verified token was in the active
vocabulary and whether the draft's proposals there were all rejected. Nothing here runs
the draft or decides admission (see ``gate.py``); the decode thread only copies and
takes one top-k.

Steps (EAGLE pairing, see ``decoding/drafter.py``): step 1 is the draft output at the root's
pair, which predicts the first verified token; step j > 1 feeds (step j-1's output,
verified token j-1) and predicts verified token j. A round with a accepted tokens has
a + 1 steps; the last one predicts the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Trajectory:
    ctx_features: torch.Tensor  # [c, D] committed target features, the root's pair last (c <= context)
    ctx_tokens: torch.Tensor  # [c] the token after each of them (the root token last)
    tokens: torch.Tensor  # [s] verified ids: the accepted tokens, then the bonus
    support_ids: torch.Tensor  # [s, K] target's top-K ids per step (incl. the verified id)
    support_logits: torch.Tensor  # [s, K] their target logits
    target_index: torch.Tensor  # [s] where the verified id sits in its support row
    in_vocab: torch.Tensor  # [s] bool: verified id was in the round's active vocabulary
    rejected: torch.Tensor  # [s] bool: the draft proposed children there and none was accepted
    key: str | None = None  # adapter scope (conversation / tenant) it belongs to
    ready: object | None = None  # CUDA: an event marking when these tensors are written

    @property
    def steps(self) -> int:
        return int(self.tokens.shape[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.ctx_features,
            self.ctx_tokens,
            self.tokens,
            self.support_ids,
            self.support_logits,
            self.target_index,
            self.in_vocab,
            self.rejected,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def retained_support(
    logits: torch.Tensor,  # [s, V] target logits at the path nodes
    verified: torch.Tensor,  # [s] verified ids
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k support per row, forced to contain the verified id -> (ids, logits, index) [s, k]."""
    k = min(k, logits.shape[-1])
    top = torch.topk(logits, k, dim=-1)
    ids, vals = top.indices, top.values  # [s, k]
    hit = ids == verified[:, None]  # [s, k]
    found = hit.any(-1)  # [s]
    # a sampled token outside the top-k replaces the weakest retained id
    last = torch.full_like(verified, k - 1)
    index = torch.where(found, hit.float().argmax(-1), last)  # [s]
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids = ids.clone()
    vals = vals.clone()
    ids[rows, index] = torch.where(found, ids[rows, index], verified)
    vals[rows, index] = torch.where(found, vals[rows, index], logits[rows, verified])
    return ids, vals, index


class Recorder:
    """Per-request context ring and trajectory builder (decode thread only)."""

    def __init__(self, context: int, k_logit: int) -> None:
        self.context = context
        self.k_logit = k_logit
        self._feats: torch.Tensor | None = None  # [<= context, D]
        self._tokens: torch.Tensor | None = None  # [<= context]

    def start(self) -> None:
        self._feats = self._tokens = None

    def commit(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """The pairs the drafter commits this round: features [m, D], tokens [m]."""
        c = self.context
        if self._feats is None:
            self._feats, self._tokens = features[-c:].clone(), tokens[-c:].clone()
        else:
            self._feats = torch.cat([self._feats, features])[-c:]
            self._tokens = torch.cat([self._tokens, tokens])[-c:]

    def trajectory(
        self,
        tree_parents: torch.Tensor,  # [N] parent node of every tree node (-1: root)
        path: torch.Tensor,  # [a + 1] verified path node indices, root first
        verified: torch.Tensor,  # [a + 1] accepted ids, then the bonus
        path_logits: torch.Tensor,  # [a + 1, V] target logits at the path nodes
        active: torch.Tensor | None,  # [V] bool this round's active vocabulary (None: all)
        key: str | None = None,
    ) -> Trajectory:
        if self._feats is None:
            raise RuntimeError("Recorder.trajectory before any commit")
        ids, vals, index = retained_support(path_logits.float(), verified, self.k_logit)
        s = verified.shape[0]
        in_vocab = active[verified] if active is not None else torch.ones(s, dtype=torch.bool)
        # accepted steps were proposed and accepted; the bonus step was rejected iff the last
        # path node had children in the tree (a leaf proposed nothing there)
        rejected = torch.zeros(s, dtype=torch.bool, device=verified.device)
        rejected[-1] = (tree_parents == path[-1]).any()
        return Trajectory(
            ctx_features=self._feats,
            ctx_tokens=self._tokens,
            tokens=verified.clone(),
            support_ids=ids,
            support_logits=vals,
            target_index=index,
            in_vocab=in_vocab.clone(),
            rejected=rejected,
            key=key,
        )

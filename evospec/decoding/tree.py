"""EAGLE-2 dynamic draft tree: expansion by cumulative log-probability, then global rerank.

Owns: :class:`DraftTree` (a dataclass of tensors) and :func:`build_tree`; the shape settings,
:class:`TreeConfig`, live in ``tree_config.py`` (no torch, so the command line reads them).
The tree is built with tensor ops only (``topk``/``sort``/indexing); no value is read back to
the host while drafting.

Algorithm (Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", 2024): the root's top-k children form the first frontier; at each further depth every
frontier node proposes its top-k children, scored by the sum of log-probabilities along the
path, and the global top-k of those k*k candidates become the next frontier. After ``depth``
levels, all candidates ever proposed are reranked by score and the best ``total_tokens`` kept.
A child's score never exceeds its parent's (log-probs are <= 0) and parents are proposed
first, so a stable sort keeps every selected node's parent: the result is a tree, listed
parents before children.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from evospec.decoding.tree_config import TreeConfig


@dataclass
class DraftTree:
    """A verified-in-one-forward token tree; node 0 is the root (last committed token)."""

    tokens: torch.Tensor  # [N] int64 target token ids
    parents: torch.Tensor  # [N] int64 parent node index; -1 for the root
    depths: torch.Tensor  # [N] int64; 0 for the root
    mask: torch.Tensor  # [N, N] bool; mask[i, j] = j is i or an ancestor of i
    positions: torch.Tensor  # [N] int64 absolute positions: prefix_len + depth
    scores: torch.Tensor  # [N] float cumulative draft log-prob (root 0)
    max_depth: int  # upper bound on depths (the configured depth), known without a host sync

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def paths(self) -> torch.Tensor:
        """[num_leaves, max_depth + 1] root-to-leaf node indices, padded with -1."""
        is_parent = torch.zeros(self.size, dtype=torch.bool, device=self.tokens.device)
        is_parent[self.parents[1:]] = True
        leaves = torch.nonzero(~is_parent).flatten()
        width = self.max_depth + 1
        out = torch.full((leaves.numel(), width), -1, dtype=torch.long, device=self.tokens.device)
        for row, leaf in enumerate(leaves.tolist()):
            nodes = torch.nonzero(self.mask[leaf]).flatten()  # ancestors ascend by index = depth
            out[row, : nodes.numel()] = nodes
        return out

    def path_to(self, node: int) -> torch.Tensor:
        """[depth(node) + 1] node indices from the root to ``node``."""
        return torch.nonzero(self.mask[node]).flatten()


class TreeExpander(Protocol):
    """What :func:`build_tree` needs from a drafter (see ``drafter.py``)."""

    def expand(
        self, tokens: torch.Tensor, parent_rows: torch.Tensor | None, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward frontier ``tokens`` [k']; return their children's top-k (logp, ids) [k', k].

        ``parent_rows`` [k'] indexes the rows of the previous ``expand`` call (None: the root).
        """
        ...


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, N] bool ancestor-or-self matrix from a parent vector (parents precede children)."""
    n = parents.shape[0]
    idx = torch.arange(n, device=parents.device)
    mask = torch.zeros(n, n, dtype=torch.bool, device=parents.device)
    mask[idx, idx] = True
    cur = parents.clone()
    for _ in range(max_depth):
        valid = cur >= 0
        mask[idx[valid], cur[valid]] = True
        cur = torch.where(valid, parents[cur.clamp(min=0)], cur)
    return mask


def build_tree(
    drafter: TreeExpander,
    root_token: int,
    root_logp: torch.Tensor,  # [K] top-k log-probs of the root's children (K >= top_k)
    root_ids: torch.Tensor,  # [K] their token ids
    prefix_len: int,  # committed tokens in the target cache; the root sits at this position
    cfg: TreeConfig,
) -> DraftTree:
    k = cfg.top_k
    device = root_ids.device
    scores = [root_logp[:k].float()]  # per level: candidate scores
    tokens = [root_ids[:k]]
    parents = [
        torch.full((min(k, root_ids.numel()),), -1, dtype=torch.long, device=device)
    ]  # pool parent idx
    depth_of = [torch.ones_like(tokens[0])]
    frontier_tokens, frontier_scores = tokens[0], scores[0]
    frontier_pool = torch.arange(frontier_tokens.numel(), device=device)
    parent_rows: torch.Tensor | None = None
    offset = frontier_tokens.numel()
    for d in range(2, cfg.depth + 1):
        logp, ids = drafter.expand(frontier_tokens, parent_rows, k)  # [k', k] each
        cand = (frontier_scores[:, None] + logp.float()).flatten()  # [k' * k]
        cand_parent = frontier_pool.repeat_interleave(logp.shape[1])
        scores.append(cand)
        tokens.append(ids.flatten())
        parents.append(cand_parent)
        depth_of.append(torch.full_like(cand_parent, d))
        best = torch.topk(cand, min(k, cand.numel())).indices
        parent_rows = best // logp.shape[1]
        frontier_tokens, frontier_scores = ids.flatten()[best], cand[best]
        frontier_pool = offset + best
        offset += cand.numel()
    all_scores = torch.cat(scores)
    order = torch.sort(-all_scores, stable=True).indices[: cfg.total_tokens]
    keep = torch.sort(order).values  # pool order: parents before children
    pool_parent = torch.cat(parents)[keep]
    # Map pool indices -> tree node indices (root = 0, kept nodes = 1..T).
    node_of = torch.full((all_scores.numel(),), -1, dtype=torch.long, device=device)
    node_of[keep] = torch.arange(1, keep.numel() + 1, device=device)
    tree_parents = torch.where(pool_parent >= 0, node_of[pool_parent.clamp(min=0)], 0)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    parents_t = torch.cat([zero - 1, tree_parents])
    depths_t = torch.cat([zero, torch.cat(depth_of)[keep]])
    return DraftTree(
        tokens=torch.cat([torch.tensor([root_token], device=device), torch.cat(tokens)[keep]]),
        parents=parents_t,
        depths=depths_t,
        mask=ancestor_mask(parents_t, cfg.depth),
        positions=prefix_len + depths_t,
        scores=torch.cat([torch.zeros(1, device=device), all_scores[keep]]),
        max_depth=cfg.depth,
    )

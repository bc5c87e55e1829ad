"""EAGLE-2 dynamic draft tree: expansion by cumulative log-probability, then global rerank.

Owns: :class:`DraftTree` (a dataclass of tensors) and :func:`build_tree`; the shape settings,
:class:`TreeConfig`, live in ``tree_config.py`` (no torch, so the command line reads them).
A branching tree is built with tensor ops only (``topk``/``sort``/indexing); no value is read
back to the host while drafting (a CPU's chains and fans, below, are built from host values).

Algorithm (Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", 2024): the root's top-k children form the first frontier; at each further depth every
frontier node proposes its top-k children, scored by the sum of log-probabilities along the
path, and the global top-k of those k*k candidates become the next frontier. After ``depth``
levels, all candidates ever proposed are reranked by score and the best ``total_tokens`` kept.
A child's score never exceeds its parent's (log-probs are <= 0) and parents are proposed
first, so a stable sort keeps every selected node's parent: the result is a tree, listed
parents before children.

With ``top_k == 1`` the tree is a chain: every level holds one node and the rerank keeps its
first ``min(depth, total_tokens)`` levels, so :func:`build_tree` drafts exactly those and
takes the chain's structure (parents, depths, mask) from a table built once per length. The
result is the tree the general path builds, marked ``chain`` so that acceptance and the KV
cache can skip what a chain does not need (on this CPU the general path costs ~0.27 ms a
round for a 1-token chain, most of a cheap draft). Under sampling a chain may instead draw
its tokens from the draft's distribution (a ``proposal.DraftSampler``); the tree then keeps
each draw's distribution for the verify's ratio test (``DraftTree.proposals``).

With ``depth == 1`` on a CPU the tree is a fan: the root's ``top_k`` children from the draft's
commit, built from host values with a shape shared by every round (parents, depths, mask and the
mask's rows as bit sets, ``DraftTree.bits``, which a recorded tree verify takes; ``models/step.py``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from evospec.decoding.proposal import DraftSampler, Proposal
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
    chain: bool = False  # node i sits at depth i, its parent is node i - 1 (a top_k = 1 shape)
    # a sampled chain: proposals[i] is the draft distribution node i + 1 was drawn from (verify.py
    # then accepts by the ratio test); None: every node is a proposal of its own (a point mass)
    proposals: tuple[Proposal, ...] | None = None
    bits: torch.Tensor | None = None  # [N] int64: mask's rows as bit sets (fused.tree_bits), if built

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
        self, tokens: torch.Tensor, parent_rows: torch.Tensor | None, k: int, choose=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward frontier ``tokens`` [k']; return their children's top-k (logp, ids) [k', k]
        (or what ``choose``, a ``vocab/head.py: Chooser``, picks instead).

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
    sampler: DraftSampler | None = None,
) -> DraftTree:
    """``sampler``: a chain's draws (it also drew ``root_ids``, at the drafter's commit); the
    tree keeps its proposals. Only a chain takes one."""
    if cfg.top_k == 1:
        return _build_chain(drafter, root_token, root_logp, root_ids, prefix_len, cfg, sampler)
    if sampler is not None:
        raise ValueError("sampled drafts make chains (tree.top_k 1)")
    if cfg.depth == 1 and root_ids.device.type == "cpu":
        return _build_fan(root_token, root_logp, root_ids, prefix_len, min(cfg.top_k, cfg.total_tokens))
    return _build_expanded(drafter, root_token, root_logp, root_ids, prefix_len, cfg)


def _build_expanded(
    drafter: TreeExpander,
    root_token: int,
    root_logp: torch.Tensor,
    root_ids: torch.Tensor,
    prefix_len: int,
    cfg: TreeConfig,
) -> DraftTree:
    """:func:`build_tree`'s general path: EAGLE-2's expansion and rerank in tensor ops."""
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


def _build_chain(
    drafter: TreeExpander,
    root_token: int,
    root_logp: torch.Tensor,  # [K >= 1]
    root_ids: torch.Tensor,  # [K >= 1]
    prefix_len: int,
    cfg: TreeConfig,
    sampler: DraftSampler | None = None,
) -> DraftTree:
    """The top_k = 1 tree: the draft's greedy chain (with ``sampler``: its draws),
    ``min(depth, total_tokens)`` tokens, or with ``cfg.min_prob`` its longest prefix whose draft
    probability stays >= min_prob (possibly none: the root alone). The stop reads each step's
    log-prob on the host: a chain decides its own length as it goes, and the steps it stops
    before are never drafted."""
    n = min(cfg.depth, cfg.total_tokens)
    floor = math.log(cfg.min_prob) if cfg.min_prob > 0 else None
    tokens, logps = [root_ids[:1]], [root_logp[:1].float()]
    total = float(logps[0]) if floor is not None else 0.0
    if floor is not None and total < floor:
        tokens, logps = [], []
    while 0 < len(tokens) < n:
        logp, ids = drafter.expand(tokens[-1], None, 1, choose=sampler)  # [1, 1] each
        if floor is not None:
            total += float(logp[0, 0])
            if total < floor:
                break
        tokens.append(ids[0, :1])
        logps.append(logp[0, :1].float())
    device = root_ids.device
    if device.type == "cpu":  # values on the host already: 3 tensors instead of ~9 small ops
        scores = list(itertools.accumulate(lp.item() for lp in logps))  # [L]
        drafted = [root_token, *(t.item() for t in tokens)]
        tree = _chain(torch.tensor(drafted), torch.tensor([0.0, *scores]), prefix_len, cfg.depth)
    else:  # no host read while drafting on an accelerator
        scores = torch.cat(logps).cumsum(0) if logps else torch.zeros(0, device=device)  # [L]
        drafted = torch.cat([torch.tensor([root_token], device=device), *tokens])
        tree = _chain(drafted, torch.cat([scores.new_zeros(1), scores]), prefix_len, cfg.depth)
    if sampler is not None:  # a stop may leave the last draw undrafted
        tree.proposals = tuple(sampler.proposals[: len(tokens)])
    return tree


def _build_fan(
    root_token: int, root_logp: torch.Tensor, root_ids: torch.Tensor, prefix_len: int, k: int
) -> DraftTree:
    """A depth-1 tree from host values: the root's ``k`` most likely children (the tree
    :func:`build_tree`'s general path keeps, in the same order), its shape shared by every round."""
    k = min(k, root_ids.numel())
    parents, depths, mask, bits = _fan_shape(k)
    return DraftTree(
        tokens=torch.tensor([root_token, *root_ids[:k].tolist()]),
        parents=parents,
        depths=depths,
        mask=mask,
        positions=depths + prefix_len,
        scores=torch.tensor([0.0, *root_logp[:k].float().tolist()]),
        max_depth=1,
        bits=bits,
    )


@functools.lru_cache(maxsize=16)
def _fan_shape(k: int) -> tuple[torch.Tensor, ...]:
    """The root and k children: (parents [k + 1], depths [k + 1], ancestor mask [k + 1, k + 1],
    its rows as bit sets [k + 1]), shared by every round (callers never write them)."""
    with torch.inference_mode(False):
        depths = torch.ones(k + 1, dtype=torch.long)
        depths[0] = 0
        mask = torch.eye(k + 1, dtype=torch.bool)
        mask[:, 0] = True
        bits = torch.tensor([1] + [1 | 1 << i for i in range(1, k + 1)])
        return depths - 1, depths, mask, bits


def chain_tree(root_token: int, drafted: list[int], prefix_len: int, device: torch.device) -> DraftTree:
    """A chain of tokens proposed without draft scores (context lookup): the root, then
    ``drafted`` (possibly none: the root alone); every node scores 0."""
    tokens = torch.tensor([root_token, *drafted], dtype=torch.long, device=device)  # [n + 1]
    return _chain(tokens, _zeros(len(drafted) + 1, str(device)), prefix_len, len(drafted))


def _chain(tokens: torch.Tensor, scores: torch.Tensor, prefix_len: int, max_depth: int) -> DraftTree:
    n = tokens.shape[0]
    parents, depths, mask = _chain_shape(n - 1, str(tokens.device))
    return DraftTree(
        tokens=tokens,
        parents=parents,
        depths=depths,
        mask=mask,
        positions=torch.arange(prefix_len, prefix_len + n, device=tokens.device),  # depths + prefix_len
        scores=scores,
        max_depth=max_depth,
        chain=True,
    )


@functools.lru_cache(maxsize=64)
def _zeros(n: int, device: str) -> torch.Tensor:
    """[n] float zeros, shared by every lookup round of that length (callers never write them)."""
    with torch.inference_mode(False):
        return torch.zeros(n, device=device)


@functools.lru_cache(maxsize=64)
def _chain_shape(n: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chain of n drafted nodes: (parents [n + 1], depths [n + 1], ancestor mask [n + 1, n + 1]),
    shared by every round (callers never write them). Plain tensors even when first asked for
    under inference mode, so that training code may index with them."""
    with torch.inference_mode(False):
        depths = torch.arange(n + 1, device=device)
        mask = torch.ones(n + 1, n + 1, dtype=torch.bool, device=device).tril()
        return depths - 1, depths, mask

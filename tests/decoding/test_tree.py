"""EAGLE-2 tree building on a scripted expander: structure, scores, frontier and rerank."""

from __future__ import annotations

import itertools

import torch

from evospec.decoding.tree import TreeConfig, ancestor_mask, build_tree

V = 50


class ScriptedExpander:
    """Children log-probs depend only on the parent token: logp(child c | parent t) fixed."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(V, V, generator=gen) * 2, dim=-1)  # [parent, child]
        self.calls: list[tuple[list[int], list[int] | None]] = []

    def expand(self, tokens, parent_rows, k):
        self.calls.append((tokens.tolist(), None if parent_rows is None else parent_rows.tolist()))
        top = torch.topk(self.table[tokens], k, dim=-1)
        return top.values, top.indices


def root_topk(exp: ScriptedExpander, root: int, k: int):
    top = torch.topk(exp.table[root], k)
    return top.values, top.indices


def build(cfg: TreeConfig, root: int = 7, seed: int = 0):
    exp = ScriptedExpander(seed)
    logp, ids = root_topk(exp, root, cfg.top_k)
    return build_tree(exp, root, logp, ids, prefix_len=20, cfg=cfg), exp


def test_structure_invariants():
    cfg = TreeConfig(top_k=4, depth=4, total_tokens=20)
    tree, _ = build(cfg)
    assert tree.size == cfg.total_tokens + 1
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, tree.size):
        p = int(tree.parents[i])
        assert 0 <= p < i  # parents before children
        assert tree.depths[i] == tree.depths[p] + 1
        assert tree.scores[i] <= tree.scores[p] + 1e-6  # cumulative log-prob never grows
        # a node's score is its parent's plus logp(token | parent token)
        expect = tree.scores[p] + ScriptedExpander(0).table[tree.tokens[p], tree.tokens[i]]
        assert torch.isclose(tree.scores[i], expect, atol=1e-5)
    assert torch.equal(tree.positions, 20 + tree.depths)
    assert torch.equal(tree.mask, ancestor_mask(tree.parents, cfg.depth))
    assert int(tree.depths.max()) <= cfg.depth


def test_children_of_one_node_are_distinct():
    tree, _ = build(TreeConfig(top_k=5, depth=3, total_tokens=30))
    for p in range(tree.size):
        kids = tree.tokens[tree.parents == p].tolist()
        assert len(kids) == len(set(kids))


def test_keeps_the_globally_best_candidates():
    cfg = TreeConfig(top_k=3, depth=3, total_tokens=7)
    tree, exp = build(cfg)
    # Recompute every candidate EAGLE-2 proposes and check the kept set is its top-7 by score.
    cands = []
    r_logp, r_ids = root_topk(exp, 7, 3)
    level = [(float(s), [int(t)]) for s, t in zip(r_logp, r_ids, strict=True)]
    cands += level
    frontier = level
    for _ in range(cfg.depth - 1):
        nxt = []
        for s, path in frontier:
            top = torch.topk(exp.table[path[-1]], 3)
            nxt += [(s + float(v), [*path, int(c)]) for v, c in zip(top.values, top.indices, strict=True)]
        cands += nxt
        frontier = sorted(nxt, key=lambda x: -x[0])[:3]
    best = sorted(cands, key=lambda x: -x[0])[: cfg.total_tokens]
    kept = sorted(float(s) for s in tree.scores[1:])
    assert kept == sorted(s for s, _ in best) or torch.allclose(
        torch.tensor(kept), torch.tensor(sorted(s for s, _ in best))
    )


def test_frontier_expansion_calls():
    cfg = TreeConfig(top_k=3, depth=4, total_tokens=10)
    _, exp = build(cfg)
    assert len(exp.calls) == cfg.depth - 1
    assert exp.calls[0][1] is None  # first frontier: children of the root
    for tokens, _ in exp.calls:
        assert len(tokens) == cfg.top_k
    for _, rows in exp.calls[1:]:
        assert rows is not None and all(0 <= r < cfg.top_k for r in rows)


def test_paths_cover_every_leaf():
    tree, _ = build(TreeConfig(top_k=3, depth=3, total_tokens=9))
    paths = tree.paths()
    leaves = {int(p[p >= 0][-1]) for p in paths}
    parents = set(tree.parents[1:].tolist())
    assert leaves == set(range(tree.size)) - parents
    for p in paths:
        nodes = p[p >= 0].tolist()
        assert nodes[0] == 0
        assert all(int(tree.parents[b]) == a for a, b in itertools.pairwise(nodes))


def test_depth_one_tree_is_the_root_top_k():
    cfg = TreeConfig(top_k=4, depth=1, total_tokens=60)
    tree, exp = build(cfg)
    assert tree.size == 5 and exp.calls == []
    assert tree.tokens[1:].tolist() == root_topk(exp, 7, 4)[1].tolist()


def test_a_top1_tree_is_the_drafts_greedy_chain():
    """top_k = 1: min(depth, total_tokens) tokens, each the draft's argmax after the one before;
    no expansion beyond them; the structure of a chain, marked as one."""
    for depth, total in [(1, 1), (4, 4), (5, 3), (2, 6)]:
        cfg = TreeConfig(top_k=1, depth=depth, total_tokens=total)
        tree, exp = build(cfg)
        n = min(depth, total)
        want, scores, tok = [7], [0.0], 7
        for _ in range(n):
            nxt = int(torch.argmax(exp.table[tok]))
            scores.append(scores[-1] + float(exp.table[tok, nxt]))
            want.append(nxt)
            tok = nxt
        assert tree.chain and tree.tokens.tolist() == want
        assert len(exp.calls) == n - 1
        assert tree.parents.tolist() == list(range(-1, n))
        assert tree.depths.tolist() == list(range(n + 1))
        assert torch.equal(tree.mask, ancestor_mask(tree.parents, cfg.depth))
        assert torch.equal(tree.positions, 20 + tree.depths)
        assert torch.allclose(tree.scores, torch.tensor(scores), atol=1e-5)
        assert not build(TreeConfig(top_k=2, depth=depth, total_tokens=total))[0].chain

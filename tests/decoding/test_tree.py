"""EAGLE-2 tree building on a scripted expander: structure, scores, frontier and rerank."""

from __future__ import annotations

import itertools

import pytest
import torch

from evospec.decoding.tree import TreeConfig, ancestor_mask, build_tree

V = 50


class ScriptedExpander:
    """Children log-probs depend only on the parent token: logp(child c | parent t) fixed."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.log_softmax(torch.randn(V, V, generator=gen) * 2, dim=-1)  # [parent, child]
        self.calls: list[tuple[list[int], list[int] | None]] = []

    def expand(self, tokens, parent_rows, k, choose=None):
        self.calls.append((tokens.tolist(), None if parent_rows is None else parent_rows.tolist()))
        if choose is not None:
            return choose(self.table[tokens], None)
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


@pytest.mark.parametrize(("k", "total"), [(2, 2), (3, 3), (4, 2), (3, 10)])
def test_a_cpus_fan_is_the_general_paths_depth_one_tree(k, total):
    """Depth-1 trees on a CPU are built from host values with a shared shape (and their rows'
    bit sets for a recorded verify): every field the general expansion gives, no draft call."""
    from evospec.decoding.tree import _build_expanded
    from evospec.models.fused import tree_bits

    cfg = TreeConfig(top_k=k, depth=1, total_tokens=total)
    fan, exp = build(cfg)
    logp, ids = root_topk(exp, 7, k)
    general = _build_expanded(exp, 7, logp, ids, 20, cfg)
    assert exp.calls == [] and not fan.chain and fan.max_depth == general.max_depth == 1
    for name in ("tokens", "parents", "depths", "mask", "positions", "scores"):
        assert torch.equal(getattr(fan, name), getattr(general, name)), name
    assert torch.equal(fan.bits, tree_bits(general.mask))


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


def sampled_chain(cfg: TreeConfig, seed: int = 0):
    """A chain drawn as a sampled round draws it: the root's child from the root's row, then one
    draw per expansion; (tree, expander, sampler)."""
    import pytest

    from evospec.decoding.proposal import DraftSampler
    from evospec.decoding.sampling import SamplingParams

    exp = ScriptedExpander(seed)
    sampler = DraftSampler(SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed))
    logp, ids = sampler(exp.table[7][None], None)
    tree = build_tree(exp, 7, logp[0], ids[0], prefix_len=20, cfg=cfg, sampler=sampler)
    with pytest.raises(ValueError, match="chains"):
        build_tree(exp, 7, logp[0], ids[0], 20, TreeConfig(top_k=2, depth=2, total_tokens=3), sampler)
    return tree, exp, sampler


def test_a_sampled_chain_keeps_the_distribution_of_every_drafted_token():
    tree, exp, _ = sampled_chain(TreeConfig(top_k=1, depth=4, total_tokens=4))
    assert tree.chain and tree.size == 5 and len(exp.calls) == 3
    assert len(tree.proposals) == 4
    tokens = tree.tokens.tolist()
    for i, prop in enumerate(tree.proposals):
        q = torch.softmax(exp.table[tokens[i]], -1)  # node i's row: its child was drawn from it
        assert torch.allclose(prop.probs, q, atol=1e-6)
        assert abs(prop.token_prob - float(q[tokens[i + 1]])) < 1e-6
    # scores: each node's confidence (max q), not the draws' own probabilities
    conf = [float(torch.softmax(exp.table[t], -1).max().log()) for t in tokens[:-1]]
    assert torch.allclose(tree.scores[1:], torch.tensor(conf).cumsum(0), atol=1e-5)


def test_draws_that_vary_make_other_chains_than_the_greedy_one():
    chains = {
        tuple(sampled_chain(TreeConfig(top_k=1, depth=3, total_tokens=3), seed)[0].tokens.tolist())
        for seed in range(8)
    }
    assert len(chains) > 1


def test_a_stopping_sampled_chain_keeps_the_proposals_of_the_tokens_it_kept():
    sizes = set()
    for seed in range(8):
        tree, _, sampler = sampled_chain(TreeConfig(top_k=1, depth=4, total_tokens=4, min_prob=0.05), seed)
        assert len(tree.proposals) == tree.size - 1 <= len(sampler.proposals)
        sizes.add(tree.size)
    assert len(sizes) > 1  # the stop really cut chains


def test_sample_drafts_must_be_a_bool():
    import pytest

    with pytest.raises(ValueError, match="sample_drafts must be true or false"):
        TreeConfig(sample_drafts=1)

"""Lazy verification rows: the same acceptance as all-node logits, fewer rows projected."""

from __future__ import annotations

import math
import time

import pytest
import torch

from evospec.decoding.node_logits import NodeLogits, calibrate_prefetch
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import DraftTree, TreeConfig, ancestor_mask
from evospec.decoding.verify import accept, greedy_accept, greedy_walk, sample_accept
from tests.decoding.spec_helpers import (
    ar_tokens,
    eagle_drafter,
    perturbed_drafter,
    prompt_of,
    spec_events,
    spec_tokens,
    tiny_target,
)

V, D = 12, 8


def random_tree(seed: int, n: int = 14) -> DraftTree:
    """A random tree (distinct sibling tokens) with draft scores that fall with depth."""
    g = torch.Generator().manual_seed(seed)
    parents, tokens, scores, depths = [-1], [int(torch.randint(V, (), generator=g))], [0.0], [0]
    used: dict[int, set[int]] = {}
    while len(parents) < n:
        par = int(torch.randint(len(parents), (), generator=g))
        free = [t for t in range(V) if t not in used.setdefault(par, set())]
        if not free or depths[par] >= 4:
            continue
        tok = free[int(torch.randint(len(free), (), generator=g))]
        used[par].add(tok)
        parents.append(par)
        tokens.append(tok)
        depths.append(depths[par] + 1)
        scores.append(scores[par] + math.log(float(torch.rand((), generator=g)) * 0.9 + 0.05))
    par = torch.tensor(parents)
    dep = torch.tensor(depths)
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=par,
        depths=dep,
        mask=ancestor_mask(par, 4),
        positions=dep + 3,
        scores=torch.tensor(scores),
        max_depth=4,
    )


class CountingHead:
    """A projector onto V tokens that records the rows of each call."""

    def __init__(self, seed: int) -> None:
        self.weight = torch.randn(V, D, generator=torch.Generator().manual_seed(seed)) * 3
        self.calls: list[int] = []

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.calls.append(h.shape[0])
        return h @ self.weight.T


def tree_and_rows(seed: int, prefetch: float):
    tree = random_tree(seed)
    hidden = torch.randn(tree.size, D, generator=torch.Generator().manual_seed(100 + seed))
    head = CountingHead(seed)
    # make the target agree with the draft often, so walks go deep
    for node, par in enumerate(tree.parents.tolist()):
        if par >= 0 and node % 2:
            hidden[par] = head.weight[tree.tokens[node]] * 2
    return tree, hidden, head, NodeLogits(tree, hidden, head, prefetch)


@pytest.mark.parametrize("prefetch", [0.0, 0.2, 0.6, 1.0])
@pytest.mark.parametrize("seed", range(12))
def test_greedy_walk_matches_the_vectorised_rule(seed, prefetch):
    tree, hidden, head, rows = tree_and_rows(seed, prefetch)
    full = hidden @ head.weight.T
    path, bonus = greedy_walk(tree, rows)
    ref_path, ref_bonus = greedy_accept(tree, full)
    assert path.tolist() == ref_path.tolist() and bonus == ref_bonus
    # the same rows (to rounding: a matmul over fewer rows may round differently)
    torch.testing.assert_close(rows.stack(path.tolist()), full[path], rtol=1e-5, atol=1e-4)
    assert rows.projected <= tree.size


@pytest.mark.parametrize("seed", range(12))
def test_path_only_projects_one_row_per_visited_node(seed):
    tree, _, head, rows = tree_and_rows(seed, prefetch=1.0)
    path, _ = greedy_walk(tree, rows)
    assert head.calls == [1] * len(path)


@pytest.mark.parametrize("seed", range(6))
def test_zero_threshold_projects_the_root_subtree_in_one_call(seed):
    tree, _, head, rows = tree_and_rows(seed, prefetch=0.0)
    greedy_walk(tree, rows)
    assert head.calls == [tree.size]


def test_prefetch_follows_the_draft_probability_given_the_node():
    # root -> a (p 0.9) -> b (p 0.5); root -> c (p 0.1)
    par = torch.tensor([-1, 0, 1, 0])
    tree = DraftTree(
        tokens=torch.tensor([0, 1, 2, 3]),
        parents=par,
        depths=torch.tensor([0, 1, 2, 1]),
        mask=ancestor_mask(par, 2),
        positions=torch.tensor([5, 6, 7, 6]),
        scores=torch.tensor([0.0, math.log(0.9), math.log(0.9 * 0.5), math.log(0.1)]),
        max_depth=2,
    )
    head = CountingHead(0)
    rows = NodeLogits(tree, torch.randn(4, D), head, prefetch=0.4)
    rows[0]
    assert head.calls == [3]  # root + a (0.9) + b (0.45); not c (0.1)
    rows[3]
    assert head.calls == [3, 1]
    rows[1], rows[2]
    assert head.calls == [3, 1] and rows.projected == 4


@pytest.mark.parametrize("seed", range(8))
def test_sampling_reads_the_same_rows_lazily(seed):
    tree, hidden, head, rows = tree_and_rows(seed, prefetch=0.3)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    full = hidden @ head.weight.T
    a = sample_accept(tree, full, params, torch.Generator().manual_seed(seed))
    b = accept(tree, rows, params, torch.Generator().manual_seed(seed))
    assert a[0].tolist() == b[0].tolist() and a[1] == b[1]


def test_calibration_reads_the_cost_shape():
    def bandwidth_bound(h):  # one fixed cost per call, rows nearly free
        time.sleep(0.02)
        return h

    def compute_bound(h):  # cost proportional to rows
        time.sleep(0.01 * h.shape[0])
        return h

    assert calibrate_prefetch(bandwidth_bound, D) < 0.1
    assert calibrate_prefetch(compute_bound, D) == 1.0


# -- end to end: the round loop with lazy rows is still plain decoding -----------------------
TREES = (TreeConfig(top_k=4, depth=4, total_tokens=12), TreeConfig(top_k=1, depth=3, total_tokens=3))


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.mark.parametrize("prefetch", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("tree", TREES, ids=["k4d4t12", "chain3"])
@pytest.mark.parametrize("seed", range(4))
def test_lazy_verification_equals_ar(target, tree, seed, prefetch):
    drafter = perturbed_drafter(target, noise=0.6, seed=seed) if seed % 2 else eagle_drafter(target, seed)
    prompt = prompt_of(seed, 4 + 3 * seed)
    params = SamplingParams(max_new_tokens=24)
    assert spec_tokens(target, drafter, prompt, params, tree, prefetch=prefetch) == ar_tokens(
        target, prompt, params
    )


@pytest.mark.parametrize("seed", range(3))
def test_lazy_verification_equals_ar_on_gemma3_layers(seed):
    """Sliding-window and global layers: lazy rows still give plain decoding's tokens."""
    target = tiny_target(3, family="gemma3")
    drafter = eagle_drafter(target, seed)  # target drafters cannot run trees over sliding windows
    prompt = prompt_of(seed, 5 + 4 * seed)  # past the window of 6 once decoding starts
    params = SamplingParams(max_new_tokens=24)
    tokens = spec_tokens(target, drafter, prompt, params, TREES[0], prefetch=0.3)
    assert tokens == ar_tokens(target, prompt, params)


@pytest.mark.parametrize("seed", range(4))
def test_lazy_sampling_draws_what_eager_sampling_draws(target, seed):
    drafter = perturbed_drafter(target, noise=0.3, seed=seed)
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=20, seed=seed)
    prompt = prompt_of(seed, 6)
    eager = spec_events(target, drafter, prompt, params, TREES[0])
    lazy = spec_events(target, drafter, prompt, params, TREES[0], prefetch=0.3)
    assert [ev.tokens for ev in lazy] == [ev.tokens for ev in eager]
    assert sum(ev.accepted for ev in lazy) > 0  # drafts were accepted: the walk went down the tree


def test_verify_prefetch_choices(target):
    from evospec.decoding.methods import verify_prefetch

    assert verify_prefetch(target, "all") is None
    assert verify_prefetch(target, "lazy", 0.25) == 0.25
    auto = verify_prefetch(target, "auto")  # a CPU target: lazy, calibrated once
    assert auto is not None and 0.01 <= auto <= 1.0
    assert verify_prefetch(target, "lazy") == auto
    with pytest.raises(ValueError, match="verify_logits must be one of"):
        verify_prefetch(target, "some")
    with pytest.raises(ValueError, match=r"prefetch must be in \[0, 1\]"):
        verify_prefetch(target, "lazy", 1.5)

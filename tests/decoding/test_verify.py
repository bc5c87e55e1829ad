"""Acceptance rules on hand-built trees: greedy path choice and lossless tree rejection sampling."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.sampling import SamplingParams, target_probs
from evospec.decoding.tree import DraftTree, ancestor_mask
from evospec.decoding.verify import greedy_accept, sample_accept

V = 6


def make_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    par = torch.tensor(parents)
    depths = torch.zeros(len(parents), dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            depths[i] = depths[p] + 1
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=par,
        depths=depths,
        mask=ancestor_mask(par, 4),
        positions=10 + depths,
        scores=-depths.float(),
        max_depth=int(depths.max()),
    )


# root(0) -> a=1 (node1), b=2 (node2); node1 -> c=3 (node3), d=4 (node4); node3 -> e=5 (node5)
TREE = make_tree([0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3])


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def test_greedy_takes_the_longest_matching_path():
    # target argmax: root->1, node1->3, node3->5, node5->2 : path 0,1,3,5 then bonus 2
    path, bonus = greedy_accept(TREE, one_hot_logits([1, 3, 0, 5, 0, 2]))
    assert path.tolist() == [0, 1, 3, 5] and bonus == 2


def test_greedy_rejects_at_the_first_mismatch():
    path, bonus = greedy_accept(TREE, one_hot_logits([2, 3, 4, 5, 0, 0]))  # root->2: node2, a leaf
    assert path.tolist() == [0, 2] and bonus == 4
    path, bonus = greedy_accept(TREE, one_hot_logits([5, 3, 0, 5, 0, 0]))  # root->5: no child matches
    assert path.tolist() == [0] and bonus == 5


@pytest.mark.parametrize("seed", range(6))
def test_greedy_on_the_host_takes_the_tensor_passes_path(seed):
    """A CPU's branching trees are accepted on the host (the argmaxes read once, the path walked
    over lists): the path and bonus of the vectorised pass an accelerator runs."""
    from evospec.decoding.verify import _greedy_host, _greedy_tensors

    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        argmaxes = torch.randint(0, V, (TREE.size,), generator=g).tolist()
        logits = one_hot_logits(argmaxes) + 0.1 * torch.randn(TREE.size, V, generator=g)
        host, tensors = _greedy_host(TREE, logits), _greedy_tensors(TREE, logits)
        assert host[0].tolist() == tensors[0].tolist() and host[1] == tensors[1]


def test_greedy_does_not_follow_a_matching_child_of_a_rejected_node():
    # node3 matches its parent's argmax, but node1 itself is rejected at the root.
    path, bonus = greedy_accept(TREE, one_hot_logits([0, 3, 0, 5, 0, 0]))
    assert path.tolist() == [0] and bonus == 0


# -- sampling -------------------------------------------------------------------------------------
LOGITS = torch.tensor(
    [
        [0.5, 1.5, 1.0, -0.5, 0.2, 0.0],  # root
        [1.0, 0.0, 0.3, 1.2, 0.8, -1.0],  # node1 (token 1)
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # node2
        [0.2, 0.4, 0.6, 0.8, 1.0, 1.2],  # node3 (token 3)
        [0.0, 2.0, 0.0, 0.0, 0.0, 0.0],  # node4
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # node5
    ]
)
PARAMS = SamplingParams(temperature=0.9, top_p=0.95)


def exact_first_token() -> torch.Tensor:
    return target_probs(LOGITS[0], PARAMS)


def first_token_counts(rule, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(n):
        path, bonus = rule(TREE, LOGITS, PARAMS, gen)
        emitted = [*TREE.tokens[path[1:]].tolist(), bonus]
        counts[emitted[0]] += 1
    return counts


def second_token_given_first(
    rule, first: int, node: int, n: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empirical p(x2 | x1 = first) from rounds whose first token is ``first`` (a drafted node)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    for _ in range(n):
        path, bonus = rule(TREE, LOGITS, PARAMS, gen)
        emitted = [*TREE.tokens[path[1:]].tolist(), bonus]
        if emitted[0] == first:
            counts[emitted[1]] += 1
    return counts, target_probs(LOGITS[node], PARAMS)


def chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square at roughly the 0.1% level for <= 5 degrees of freedom."""
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token the target forbids"
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat < 20.5


N = 6_000


def test_rejection_sampling_matches_the_target_first_token():
    assert chi2_ok(first_token_counts(sample_accept, N), exact_first_token())


def test_rejection_sampling_matches_the_target_given_an_accepted_draft():
    counts, probs = second_token_given_first(sample_accept, first=1, node=1, n=N)
    assert counts.sum() > 1000
    assert chi2_ok(counts, probs)


def biased_accept(tree, logits, params, gen):
    """A plausible-looking but wrong rule: accept a child whenever p(child) > u (no renormalising),
    and always fall back to the target's most likely remaining token."""
    probs = target_probs(logits, params)
    node, path = 0, [0]
    while True:
        kids = [i for i in range(tree.size) if int(tree.parents[i]) == node]
        for child in kids:
            if torch.rand((), generator=gen) < 2 * probs[node, tree.tokens[child]]:
                path.append(child)
                node = child
                break
        else:
            return torch.tensor(path), int(torch.argmax(probs[node]))


def test_the_bound_rejects_a_biased_acceptance_rule():
    assert not chi2_ok(first_token_counts(biased_accept, N), exact_first_token())


def test_sampling_never_emits_tokens_outside_top_p():
    params = SamplingParams(temperature=1.0, top_p=0.5)
    gen = torch.Generator().manual_seed(0)
    allowed = target_probs(LOGITS[0], params) > 0
    for _ in range(500):
        path, bonus = sample_accept(TREE, LOGITS, params, gen)
        first = [*TREE.tokens[path[1:]].tolist(), bonus][0]
        assert allowed[first]


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_acceptance_repeats(seed):
    a = [sample_accept(TREE, LOGITS, PARAMS, torch.Generator().manual_seed(seed)) for _ in range(1)]
    b = [sample_accept(TREE, LOGITS, PARAMS, torch.Generator().manual_seed(seed)) for _ in range(1)]
    assert a[0][0].tolist() == b[0][0].tolist() and a[0][1] == b[0][1]


@pytest.mark.parametrize("argmaxes", [[1, 2, 3, 4], [1, 2, 0, 0], [0, 2, 3, 4], [1, 5, 3, 1], [1, 2, 3, 0]])
def test_a_chain_is_accepted_as_the_general_rule_accepts_it(argmaxes):
    """The chain shortcut (decided on the host) takes the path and bonus the tensor rule takes."""
    from dataclasses import replace

    chain = replace(make_tree([0, 1, 2, 3], [-1, 0, 1, 2]), chain=True)
    general = replace(chain, chain=False)
    path, bonus = greedy_accept(chain, one_hot_logits(argmaxes))
    ref_path, ref_bonus = greedy_accept(general, one_hot_logits(argmaxes))
    assert path.tolist() == ref_path.tolist() and bonus == ref_bonus


# -- sampled chains: the ratio test against the draft's distribution ------------------------------
Q_ROOT = torch.tensor([0.05, 0.1, 0.5, 0.05, 0.25, 0.05])  # the draft at the root: far from p
Q_NODE1 = torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])


def sampled_chain(gen: torch.Generator) -> DraftTree:
    """A 2-token chain drawn as a sampled draft draws it: x1 ~ Q_ROOT, x2 ~ Q_NODE1 (the hand-built
    rows stand for any x1: the law below is checked given x1)."""
    from dataclasses import replace

    from evospec.decoding.proposal import Proposal
    from evospec.decoding.tree import chain_tree

    x1 = int(torch.multinomial(Q_ROOT, 1, generator=gen))
    x2 = int(torch.multinomial(Q_NODE1, 1, generator=gen))
    proposals = (Proposal(Q_ROOT, None, float(Q_ROOT[x1])), Proposal(Q_NODE1, None, float(Q_NODE1[x2])))
    return replace(chain_tree(0, [x1, x2], 10, torch.device("cpu")), proposals=proposals)


def sampled_chain_tokens(rule, n: int, seed: int = 3) -> list[tuple[list[int], int]]:
    """(emitted tokens, accepted drafts) of ``n`` rounds of ``rule`` on fresh sampled chains."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tree = sampled_chain(gen)
        path, bonus = rule(tree, LOGITS, PARAMS, gen)
        out.append(([*tree.tokens[path[1:]].tolist(), bonus], path.numel() - 1))
    return out


def test_a_sampled_chain_emits_the_target_first_token():
    rounds = sampled_chain_tokens(sample_accept, N)
    counts = torch.bincount(torch.tensor([emitted[0] for emitted, _ in rounds]), minlength=V).float()
    assert chi2_ok(counts, exact_first_token())
    assert 0 < sum(a for _, a in rounds) < 2 * N  # drafts accepted, and rejected


def test_a_sampled_chain_emits_the_target_second_token_after_an_accepted_draft():
    rounds = sampled_chain_tokens(sample_accept, 3 * N // 2)
    second = [emitted[1] for emitted, a in rounds if a >= 1 and emitted[0] == 2]  # x1 = 2 accepted
    counts = torch.bincount(torch.tensor(second), minlength=V).float()
    assert counts.sum() > 1000
    assert chi2_ok(counts, target_probs(LOGITS[1], PARAMS))


def test_the_bound_rejects_a_chain_rule_that_resamples_from_p():
    """Accepting with min(1, p/q) but drawing the rejected node's token from p itself (not from
    max(p - q, 0)) counts the likely tokens twice: the same check fails it."""

    def resample_from_p(tree, logits, params, gen):
        p = target_probs(logits[0], params)
        x, q = int(tree.tokens[1]), tree.proposals[0]
        if torch.rand((), generator=gen) * q.token_prob < p[x]:
            return torch.tensor([0, 1]), int(
                torch.multinomial(target_probs(logits[1], params), 1, generator=gen)
            )
        return torch.tensor([0]), int(torch.multinomial(p, 1, generator=gen))

    counts = torch.bincount(
        torch.tensor([emitted[0] for emitted, _ in sampled_chain_tokens(resample_from_p, N)]), minlength=V
    ).float()
    assert not chi2_ok(counts, exact_first_token())


def test_a_draft_equal_to_the_target_is_always_accepted():
    from dataclasses import replace

    from evospec.decoding.proposal import Proposal
    from evospec.decoding.tree import chain_tree

    gen = torch.Generator().manual_seed(4)
    p0, p1 = target_probs(LOGITS[0], PARAMS), target_probs(LOGITS[1], PARAMS)
    for _ in range(200):
        x1, x2 = int(torch.multinomial(p0, 1, generator=gen)), int(torch.multinomial(p1, 1, generator=gen))
        tree = replace(
            chain_tree(0, [x1, x2], 10, torch.device("cpu")),
            proposals=(Proposal(p0, None, float(p0[x1])), Proposal(p1, None, float(p1[x2]))),
        )
        path, _ = sample_accept(tree, LOGITS, PARAMS, gen)
        assert path.tolist() == [0, 1, 2]

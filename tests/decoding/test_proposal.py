"""Sampled draft proposals: what a draw records and the law it draws by."""

from __future__ import annotations

import math

import pytest
import torch

from evospec.decoding.proposal import DraftSampler, Proposal
from evospec.decoding.sampling import SamplingParams

PARAMS = SamplingParams(temperature=0.8, top_k=4)  # q keeps the temperature, not the top-k
LOGP = torch.log_softmax(torch.tensor([[0.3, 2.0, -1.0, 1.1, 0.0, 0.7, -2.0]]), dim=-1)  # [1, 7]


def test_a_draw_records_its_distribution_and_scores_the_node_not_the_draw():
    sampler = DraftSampler(PARAMS, torch.Generator().manual_seed(0))
    ids = torch.tensor([40, 41, 42, 43, 44, 45, 46])
    q = torch.softmax(LOGP[0] / 0.8, -1)
    seen = set()
    for _ in range(60):
        score, token = sampler(LOGP, ids)
        assert score.shape == token.shape == (1, 1)
        col = int(token) - 40
        seen.add(col)
        assert math.isclose(float(score), math.log(float(q.max())), rel_tol=1e-6)  # same whatever was drawn
        prop = sampler.proposals[-1]
        assert prop.token_prob == pytest.approx(float(q[col])) and prop.token_prob > 0
    assert len(seen) >= 5  # beyond the request's top-k 4: the verify rejects what p filters out
    assert len(sampler.proposals) == 60


def test_draws_follow_the_draft_distribution_at_the_temperature():
    from scipy.stats import chisquare

    sampler = DraftSampler(PARAMS, torch.Generator().manual_seed(1))
    q = torch.softmax(LOGP[0] / 0.8, -1)
    counts = torch.zeros(7)
    for _ in range(4000):
        counts[int(sampler(LOGP, None)[1])] += 1
    keep = q > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep].numpy(), (q[keep] * 4000).numpy()).pvalue > 1e-3


def test_dense_places_mass_on_target_ids_and_skips_free_slots():
    probs = torch.tensor([0.5, 0.0, 0.25, 0.25])
    prop = Proposal(probs, torch.tensor([9, -1, 2, 5]), 0.5)
    dense = prop.dense(torch.zeros(12, dtype=torch.float64))
    assert dense.dtype == torch.float64
    expected = torch.zeros(12, dtype=torch.float64)
    expected[[9, 2, 5]] = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert torch.equal(dense, expected)  # the free slot's -1 wrote nothing (not even id 11)
    assert torch.equal(Proposal(probs, None, 0.5).dense(torch.zeros(4)), probs)


def test_the_recorded_ids_do_not_follow_a_head_that_rewrites_its_slots():
    sampler = DraftSampler(PARAMS, torch.Generator().manual_seed(2))
    ids = torch.arange(7) + 100
    sampler(LOGP, ids)
    ids.fill_(0)  # a reduced head loading another active set
    assert sampler.proposals[0].ids.tolist() == list(range(100, 107))


def test_a_sampler_refuses_greedy_requests_and_several_rows():
    with pytest.raises(ValueError, match="greedy"):
        DraftSampler(SamplingParams(temperature=0.0), torch.Generator())
    sampler = DraftSampler(PARAMS, torch.Generator())
    with pytest.raises(ValueError, match="one token a call"):
        sampler(LOGP.expand(2, -1), None)


def test_a_head_with_its_own_rows_draws_target_ids_and_maps_q_back():
    """An EAGLE-3 d2t head's rows are draft ids: the draw returns the row's target id, and the
    proposal's dense q sits at the target ids of the rows (what the ratio test divides by)."""
    from evospec.vocab.head import FullHead

    torch.manual_seed(0)
    row_ids = torch.tensor([30, 2, 17, 9, 44])  # draft row -> target id
    head = FullHead(torch.randn(5, 8), row_ids=row_ids)
    hidden = torch.randn(1, 8)
    sampler = DraftSampler(SamplingParams(temperature=1.0), torch.Generator().manual_seed(3))
    tokens = [int(head(hidden, 1, sampler)[1]) for _ in range(40)]
    assert set(tokens) <= set(row_ids.tolist()) and len(set(tokens)) > 1
    q = torch.softmax(head.project(hidden)[0], -1)
    dense = sampler.proposals[0].dense(torch.zeros(50))
    assert torch.allclose(dense[row_ids], q) and float(dense.sum()) == pytest.approx(1.0)
    for token, prop in zip(tokens, sampler.proposals, strict=True):  # q(x) sits at x's target id
        assert prop.token_prob == pytest.approx(float(prop.dense(torch.zeros(50))[token]))

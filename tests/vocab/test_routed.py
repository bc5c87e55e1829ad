"""DynaSpec's router and SpecVocab's selector and two-stage head: what they make active, their
files, and the errors for files that do not fit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from evospec.vocab.head import FullHead, TwoStageHead
from evospec.vocab.policy import RoundFeedback
from evospec.vocab.routed import DynaSpecVocab
from evospec.vocab.router import ClusterRouter, budget_prefix, load_router, save_router
from evospec.vocab.selector import LowRankSelector, load_selector, save_selector, svd_selector
from tests.vocab.helpers import trained_file

V, D = 12, 6


def test_budget_prefix_takes_clusters_in_score_order_while_they_fit() -> None:
    sizes = torch.tensor([5, 2, 4, 1])
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    chosen = budget_prefix(scores, sizes, 7)
    # row 0: order 1 (2), 2 (+4 = 6), 0 (+5 = 11 > 7: stop); row 1: 0 (5), then 1 (+2 = 7)
    assert chosen.tolist() == [[False, True, True, False], [True, True, False, False]]


def _router_toward(clusters_to_prefer: list[int], n_clusters: int = 4) -> ClusterRouter:
    router = ClusterRouter(D, n_clusters, 8)
    with torch.no_grad():
        router.fc2.weight.zero_()
        router.fc2.bias.copy_(
            torch.tensor(
                [
                    3.0 - clusters_to_prefer.index(c) if c in clusters_to_prefer else -9.0
                    for c in range(n_clusters)
                ]
            )
        )
    return router


def test_dynaspec_activates_the_routed_clusters_and_reroutes_each_round() -> None:
    clusters = np.array([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])  # sizes 3 2 4 3
    pol = DynaSpecVocab(clusters, _router_toward([2, 1, 0]), budget=6)
    pol.start(torch.tensor([1]), None, torch.zeros(D))
    assert pol.capacity == 6
    assert pol.active_mask(0).nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 8]  # 2 (4 ids) + 1 (2)
    with torch.no_grad():  # the router now prefers cluster 3 for a feature along axis 0
        pol.router.fc1.weight.zero_()
        pol.router.fc1.bias.zero_()
        pol.router.fc1.weight[0, 0] = 1.0
        pol.router.fc2.weight[3, 0] = 100.0
    fb = RoundFeedback(torch.tensor([1, 2]), torch.tensor([2]), torch.zeros(1, V), torch.eye(D)[0], False, 0)
    pol.observe(fb)
    # cluster 3 (3 ids) first; cluster 2 (4 more) would overflow 6, and the prefix stops there
    assert pol.active_mask(1).nonzero().flatten().tolist() == [9, 10, 11]
    assert pol.state()["clusters"] == [3] and pol.state()["active_size"] == 3
    with pytest.raises(ValueError, match="scores 5 clusters"):
        DynaSpecVocab(clusters, ClusterRouter(D, 5, 8), budget=6)


def test_router_file_round_trips_and_refuses_other_clusters_or_models() -> None:
    clusters = np.array([0, 1, 1, 2, 3, 3, 0, 1, 2, 2, 3, 0])
    router = ClusterRouter(D, 4, 8)
    f = trained_file(lambda path, **kw: save_router(router, path, **kw), clusters=clusters, fingerprint="abc")
    back = load_router(f, clusters=clusters, fingerprint="abc")
    x = torch.randn(3, D)
    assert torch.allclose(back(x), router(x), atol=1e-2)  # stored in fp16
    with pytest.raises(ValueError, match="other vocabulary clusters"):
        load_router(f, clusters=np.roll(clusters, 1), fingerprint="abc")
    with pytest.raises(ValueError, match="another model"):
        load_router(f, clusters=clusters, fingerprint="xyz")


def test_full_rank_svd_selector_gives_the_lm_head_logits() -> None:
    w = torch.randn(V, D)
    sel = svd_selector(w, D)
    h = torch.randn(4, D)
    assert torch.allclose(sel(h), h @ w.T, atol=1e-4)
    with pytest.raises(ValueError, match="rank must be in"):
        svd_selector(w, D + 1)


def test_selector_file_round_trips_and_refuses_other_models() -> None:
    sel = svd_selector(torch.randn(V, D), 3)
    f = trained_file(lambda path, **kw: save_selector(sel, path, **kw), fingerprint="abc")
    back = load_selector(f, vocab_size=V, dim=D, fingerprint="abc")
    assert back.rank == 3 and torch.allclose(back.codes, sel.codes, atol=1e-2)
    with pytest.raises(ValueError, match="another model"):
        load_selector(f, vocab_size=V, dim=D, fingerprint="xyz")
    with pytest.raises(ValueError, match="the model needs"):
        load_selector(f, vocab_size=V + 1, dim=D, fingerprint="abc")


def test_two_stage_head_with_every_id_a_candidate_equals_the_full_head() -> None:
    w = torch.randn(V, D)
    h = torch.randn(3, D)
    full_logp, full_ids = FullHead(w)(h, 4)
    logp, ids = TwoStageHead(w, svd_selector(w, 2), V)(h, 4)
    assert torch.equal(ids, full_ids) and torch.allclose(logp, full_logp, atol=1e-6)


def test_two_stage_head_keeps_each_row_to_its_own_candidates_plus_the_always_ids() -> None:
    w = torch.randn(V, D)
    codes = torch.zeros(V, 2)
    codes[:, 0] = torch.arange(V, dtype=torch.float32)  # approximate logit of id v: v * h_a
    sel = LowRankSelector(torch.eye(D, 2), codes)
    always = torch.zeros(V, dtype=torch.bool)
    always[0] = True
    head = TwoStageHead(w, sel, 3, always=always)
    h = torch.zeros(2, D)
    h[0, 0], h[1, 0] = 1.0, -1.0  # row 0 ranks the high ids first, row 1 the low ones
    logp, ids = head(h, 5)
    assert ids.shape == (2, 3) and bool(torch.isfinite(logp).all())  # k' = K: never a masked slot
    assert set(ids[1].tolist()) == {0, 1, 2}  # row 1: its 3 candidates (EOS 0 among them)
    assert set(ids[0].tolist()) <= {0, 9, 10, 11}  # row 0: the best 3 of its own 4
    exact = torch.log_softmax(h[0] @ w[[0, 9, 10, 11]].T, -1)  # softmax over row 0's candidates only
    assert torch.allclose(logp[0], exact.sort(descending=True).values[:3], atol=1e-6)
    assert head.seen.nonzero().flatten().tolist() == [0, 1, 2, 9, 10, 11] and head.size == 6
    head.new_round()
    assert head.size == 0


def test_int8_two_stage_head_gives_the_int8_heads_logits_over_its_candidates() -> None:
    """With the target's int8 LM head, a candidate's logit is the full int8 head's; every id a
    candidate: the two-stage head is the full int8 head."""
    from evospec.models.quant import Int8Matmul, kernels_available

    if not kernels_available("int8"):
        pytest.skip("torch without CPU int8 kernels")
    torch.manual_seed(2)
    weight = torch.randn(300, 64)
    int8 = Int8Matmul(weight, None, [300])
    hidden = torch.randn(2, 64)
    full = torch.log_softmax(int8(hidden).float(), dim=-1)
    logp, ids = TwoStageHead(weight, svd_selector(weight, 16), 300, int8=int8)(hidden, 5)
    top = torch.topk(full, 5, dim=-1)
    assert ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(logp, top.values, rtol=0, atol=1e-6)
    small = TwoStageHead(weight, svd_selector(weight, 4), 40, int8=int8)  # rank 4: fp32 ranking
    logp, ids = small(hidden, 5)
    assert small.size <= 80 and bool(small.seen[ids].all())  # proposals are candidates

"""What the decode thread records per round."""

from __future__ import annotations

import pytest
import torch

from evospec.adapt.trajectory import Recorder, retained_support


def test_support_keeps_top_k_and_forces_the_verified_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0, 2.0], [4.0, 0.0, 1.0, 2.0, 3.0]])
    ids, vals, index = retained_support(logits, torch.tensor([3, 1]), 2)
    assert ids.tolist() == [[1, 3], [0, 1]]  # row 1: id 1 is outside the top 2 -> replaces the weakest
    assert vals.tolist() == [[5.0, 3.0], [4.0, 0.0]]
    assert index.tolist() == [1, 1]
    assert torch.equal(ids.gather(1, index[:, None]).squeeze(1), torch.tensor([3, 1]))


def test_recorder_keeps_the_last_context_pairs():
    rec = Recorder(context=4, k_logit=2)
    rec.start()
    rec.commit(torch.arange(3.0)[:, None].repeat(1, 2), torch.tensor([10, 11, 12]))
    rec.commit(torch.arange(3.0, 6.0)[:, None].repeat(1, 2), torch.tensor([13, 14, 15]))
    parents = torch.tensor([-1, 0, 0, 1])
    t = rec.trajectory(parents, torch.tensor([0, 1]), torch.tensor([7, 8]), torch.randn(2, 20), None, "k")
    feats, toks = t.window()
    assert toks.tolist() == [12, 13, 14, 15]
    assert feats[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert t.tokens.tolist() == [7, 8] and t.key == "k"
    assert t.in_vocab.all()
    # the path ends at node 1, which has a child (node 3): the draft's guess there was rejected
    assert t.rejected.tolist() == [False, True]
    # the next round appends to the same store: the earlier trajectory's window is unchanged
    rec.commit(torch.full((2, 2), 9.0), torch.tensor([16, 17]))
    t2 = rec.trajectory(parents, torch.tensor([0]), torch.tensor([7]), torch.randn(1, 20), None)
    assert t2.request == t.request and t2.ctx_features is t.ctx_features
    assert t2.window()[1].tolist() == [14, 15, 16, 17] and t.window()[1].tolist() == [12, 13, 14, 15]


def test_recorder_store_grows_without_moving_shared_rows():
    rec = Recorder(context=1000, k_logit=2)
    rec.start()
    rec.commit(torch.zeros(200, 3), torch.arange(200))
    one = torch.tensor([0])
    old = rec.trajectory(one - 1, one, one, torch.randn(1, 5), None)
    rec.commit(torch.ones(250, 3), torch.arange(200, 450))  # past the first allocation
    new = rec.trajectory(one - 1, one, one, torch.randn(1, 5), None)
    assert new.ctx_features is not old.ctx_features  # reallocated ...
    assert old.window()[1].tolist() == list(range(200))  # ... the old view still reads its rows
    assert new.window()[1].tolist() == list(range(450)) and new.request == old.request
    rec.start()
    rec.commit(torch.zeros(1, 3), torch.tensor([5]))
    assert rec.trajectory(one - 1, one, one, torch.randn(1, 5), None).request != old.request


def test_a_leaf_path_end_was_not_rejected_and_oov_is_flagged():
    rec = Recorder(context=4, k_logit=3)
    rec.commit(torch.zeros(2, 2), torch.tensor([1, 2]))
    active = torch.zeros(20, dtype=torch.bool)
    active[7] = True
    parents, path, verified = torch.tensor([-1, 0, 0]), torch.tensor([0, 2]), torch.tensor([7, 9])
    t = rec.trajectory(parents, path, verified, torch.randn(2, 20), active)
    assert t.rejected.tolist() == [False, False]
    assert t.in_vocab.tolist() == [True, False]


def test_trajectory_before_commit_is_an_error():
    with pytest.raises(RuntimeError):
        one = torch.tensor([0])
        Recorder(4, 2).trajectory(one - 1, one, one + 1, torch.randn(1, 5), None)


def test_recorder_store_is_bounded_by_the_context():
    rec = Recorder(context=4, k_logit=2)
    rec.start()
    one = torch.tensor([0])
    rec.commit(torch.zeros(3, 2), torch.arange(3))
    first = rec.trajectory(one - 1, one, one, torch.randn(1, 5), None)
    for i in range(3, 40, 3):  # a long request: the store rolls instead of growing
        rec.commit(torch.full((3, 2), float(i)), torch.arange(i, i + 3))
        t = rec.trajectory(one - 1, one, one, torch.randn(1, 5), None)
        assert t.ctx_features.shape[0] <= 8
        assert t.window()[1].tolist() == list(range(i - 1, i + 3))
    assert t.request != first.request  # renumbered rows: a separate group for the worker
    assert first.window()[1].tolist() == [0, 1, 2]

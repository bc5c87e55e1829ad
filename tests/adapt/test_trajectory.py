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
    assert t.ctx_tokens.tolist() == [12, 13, 14, 15]
    assert t.ctx_features[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert t.tokens.tolist() == [7, 8] and t.key == "k"
    assert t.in_vocab.all()
    # the path ends at node 1, which has a child (node 3): the draft's guess there was rejected
    assert t.rejected.tolist() == [False, True]


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

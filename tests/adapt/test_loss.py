"""The gate and the curriculum-weighted KL objective, on hand-checkable numbers."""

from __future__ import annotations

import math

import torch

from evospec.adapt.loss import admit, curriculum_loss, curriculum_weights, first_step_ce, retained_kl
from evospec.adapt.unroll import TrajectoryBatch


def batch(b: int, s: int, k: int, **over) -> TrajectoryBatch:
    base = dict(
        features=torch.zeros(b, 1, 4),
        ctx_tokens=torch.zeros(b, 1, dtype=torch.long),
        group=torch.arange(b),
        ctx_end=torch.ones(b, dtype=torch.long),
        tokens=torch.zeros(b, s, dtype=torch.long),
        step_valid=torch.ones(b, s, dtype=torch.bool),
        support_ids=torch.arange(k).repeat(b, s, 1),
        support_logits=torch.zeros(b, s, k),
        target_index=torch.zeros(b, s, dtype=torch.long),
        in_vocab=torch.ones(b, s, dtype=torch.bool),
        rejected=torch.zeros(b, s, dtype=torch.bool),
    )
    base.update(over)
    return TrajectoryBatch(**base)


def test_curriculum_weights_formula():
    w = curriculum_weights(torch.tensor([0.0, 1.0, 2.0]), steps=3, beta=0.3)
    expect = [[1, 1, 1], [1, math.exp(-0.3), math.exp(-0.6)], [1, math.exp(-0.6), math.exp(-1.2)]]
    torch.testing.assert_close(w, torch.tensor(expect, dtype=torch.float32))
    # beta = 0 is the unweighted full-horizon objective
    assert torch.equal(curriculum_weights(torch.tensor([5.0]), 4, 0.0), torch.ones(1, 4))


def test_weights_are_detached_from_the_base_loss():
    l_base = torch.tensor([1.0], requires_grad=True)
    assert not curriculum_weights(l_base, 3, 0.3).requires_grad


def test_retained_kl_by_hand():
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.5, 0.25, 0.25])
    kl = retained_kl(p.log(), q.log(), 1.0)
    assert abs(float(kl) - float((p * (p / q).log()).sum())) < 1e-6
    assert float(retained_kl(p.log(), p.log(), 1.0)) < 1e-7
    # temperature flattens both sides: KL shrinks
    hot, cold = retained_kl(p.log() * 3, q.log() * 3, 3.0), retained_kl(p.log() * 3, q.log() * 3, 1.0)
    assert float(hot) < float(cold)


def test_kl_gradient_is_q_minus_p_at_t1():
    z_t = torch.tensor([2.0, 0.0, -1.0])
    z_d = torch.tensor([0.0, 1.0, 0.5], requires_grad=True)
    retained_kl(z_t, z_d, 1.0).backward()
    expect = torch.softmax(z_d.detach(), -1) - torch.softmax(z_t, -1)
    torch.testing.assert_close(z_d.grad, expect)


def test_first_step_ce_reads_the_verified_slot():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]])  # step 1: q = [0.25, 0.75]
    ce = first_step_ce(logits, torch.tensor([[1, 0]]))
    assert abs(float(ce) + math.log(0.75)) < 1e-6


def test_gate_routes_oov_to_the_vocabulary_path():
    b = batch(
        1,
        4,
        3,
        in_vocab=torch.tensor([[True, True, False, True]]),
        rejected=torch.tensor([[False, False, True, True]]),
        step_valid=torch.tensor([[True, True, True, False]]),
    )
    kl = torch.tensor([[0.5, 0.01, 0.5, 0.5]])
    adm = admit(b, kl, 0.1)
    # step 0: covered, KL high -> in; step 1: covered, KL low, accepted -> out;
    # step 2: OOV -> vocabulary path even though rejected; step 3: past the end -> out
    assert adm.mask.tolist() == [[True, False, False, False]]
    assert (adm.covered, adm.routed_oov, adm.by_kl, adm.by_reject) == (2, 1, 1, 0)


def test_gate_admits_a_rejected_step_with_low_kl():
    b = batch(1, 2, 3, rejected=torch.tensor([[False, True]]))
    adm = admit(b, torch.tensor([[0.0, 0.0]]), 0.1)
    assert adm.mask.tolist() == [[False, True]]
    assert adm.by_reject == 1


def test_loss_is_the_weighted_mean_over_admitted_steps():
    k = 3
    tgt = torch.tensor([2.0, 0.0, -1.0])
    b = batch(1, 2, k, support_logits=tgt.repeat(1, 2, 1))
    draft = torch.tensor([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])
    kl = retained_kl(tgt.repeat(1, 2, 1), draft, 1.0)[0]
    l_base = -torch.log_softmax(draft[0, 0], -1)[0]
    w2 = math.exp(-0.3 * float(l_base))
    both = curriculum_loss(b, draft, torch.ones(1, 2, dtype=torch.bool), temperature=1.0, beta=0.3)
    assert abs(float(both) - (float(kl[0]) + w2 * float(kl[1])) / 2) < 1e-6
    only_second = curriculum_loss(b, draft, torch.tensor([[False, True]]), temperature=1.0, beta=0.3)
    assert abs(float(only_second) - w2 * float(kl[1])) < 1e-6
    none = curriculum_loss(b, draft, torch.zeros(1, 2, dtype=torch.bool), temperature=1.0, beta=0.3)
    assert float(none) == 0.0

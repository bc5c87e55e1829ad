"""The training replay recomputes exactly what the serving drafter computed."""

from __future__ import annotations

import torch

from evospec.adapt.trajectory import Trajectory
from evospec.adapt.unroll import collate, support_logits, unroll
from evospec.decoding.drafter import EagleDrafter, FullHead
from evospec.models.eagle import new_eagle_for
from tests.decoding.spec_helpers import tiny_target

D = 32


@torch.inference_mode()
def serving_steps(drafter: EagleDrafter, feats, ctx_tokens, path) -> torch.Tensor:
    """Draft features the drafter computes for the root then along ``path``: [len(path)+1, D]."""
    drafter.start([0], 64)
    drafter.commit(feats, ctx_tokens, 2)
    out = [drafter._frontier_hidden[0]]
    for tok in path:
        drafter.expand(torch.tensor([tok]), torch.zeros(1, dtype=torch.long), 2)
        out.append(drafter._frontier_hidden[0])
    return torch.stack(out)


def make_traj(feats, ctx_tokens, verified, k=4) -> Trajectory:
    s = len(verified)
    return Trajectory(
        ctx_features=feats,
        ctx_tokens=ctx_tokens,
        tokens=torch.tensor(verified),
        support_ids=torch.arange(k).repeat(s, 1),
        support_logits=torch.zeros(s, k),
        target_index=torch.zeros(s, dtype=torch.long),
        in_vocab=torch.ones(s, dtype=torch.bool),
        rejected=torch.zeros(s, dtype=torch.bool),
    )


def test_unroll_matches_the_drafter_for_padded_batches():
    target = tiny_target(0)
    head = new_eagle_for(target, seed=3)
    head.requires_grad_(False)
    drafter = EagleDrafter(head, FullHead(target.lm_head.weight))
    gen = torch.Generator().manual_seed(0)
    cases = [(7, [5, 9, 11]), (4, [3])]  # (context pairs, verified ids); different lengths pad
    trajs, expect = [], []
    for n, verified in cases:
        feats = torch.randn(n, D, generator=gen)
        toks = torch.randint(0, 64, (n,), generator=gen)
        trajs.append(make_traj(feats, toks, verified))
        # step j > 1 feeds verified token j - 1: the serving path is verified[:-1]
        expect.append(serving_steps(drafter, feats, toks, verified[:-1]))
    with torch.no_grad():
        got = unroll(head, collate(trajs))  # [2, 3, D]
    torch.testing.assert_close(got[0], expect[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, :1], expect[1], atol=1e-5, rtol=1e-4)


def test_support_logits_pick_each_rows_ids():
    hidden = torch.randn(2, 3, D)
    lm_head = torch.randn(50, D)
    ids = torch.randint(0, 50, (2, 3, 5))
    full = hidden @ lm_head.T  # [2, 3, 50]
    torch.testing.assert_close(support_logits(hidden, lm_head, ids), full.gather(2, ids))


def test_gradient_reaches_the_head_through_every_step():
    target = tiny_target(0)
    head = new_eagle_for(target, seed=3)
    for p in head.parameters():
        p.requires_grad_(True)
    traj = make_traj(torch.randn(3, D), torch.tensor([1, 2, 3]), [4, 5, 6])
    out = unroll(head, collate([traj]))
    out[0, 2].sum().backward()  # the last step only: gradient flows back through steps 1-2
    assert head.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert head.fc.weight.grad.abs().sum() > 0


def test_trajectories_sharing_a_request_store_unroll_like_the_drafter():
    """Rounds of two requests (recorded into shared stores) and a standalone trajectory, in
    one batch: each trajectory's steps equal the drafter's on its own context."""
    from evospec.adapt.trajectory import Recorder

    target = tiny_target(0)
    head = new_eagle_for(target, seed=3)
    head.requires_grad_(False)
    drafter = EagleDrafter(head, FullHead(target.lm_head.weight))
    gen = torch.Generator().manual_seed(1)
    rec = Recorder(context=64, k_logit=4)
    trajs, expect = [], []
    for rounds in [(5, 2, 3), (4, 1)]:  # two requests
        rec.start()
        for n in rounds:  # commit n pairs, then a round with a 2-step verified path
            rec.commit(torch.randn(n, D, generator=gen), torch.randint(0, 64, (n,), generator=gen))
            verified = torch.randint(0, 64, (2,), generator=gen)
            parents, path = torch.tensor([-1, 0]), torch.tensor([0, 1])
            t = rec.trajectory(parents, path, verified, torch.randn(2, 64), None)
            feats, toks = t.window()
            trajs.append(t)
            expect.append(serving_steps(drafter, feats.clone(), toks.clone(), verified[:-1].tolist()))
    feats = torch.randn(3, D, generator=gen)
    toks = torch.randint(0, 64, (3,), generator=gen)
    trajs.append(make_traj(feats, toks, [7, 8, 9]))
    expect.append(serving_steps(drafter, feats, toks, [7, 8]))
    batch = collate(trajs)
    assert batch.features.shape[0] == 3  # one span per request, one for the standalone one
    with torch.no_grad():
        got = unroll(head, batch)
    for i, want in enumerate(expect):
        torch.testing.assert_close(got[i, : want.shape[0]], want, atol=1e-5, rtol=1e-4)

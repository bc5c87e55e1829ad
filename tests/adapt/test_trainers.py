"""Shadow trainers: what they publish, that they learn, and that bad updates are refused."""

from __future__ import annotations

import pytest
import torch

from evospec.adapt.config import AdaptConfig
from evospec.adapt.loss import retained_kl
from evospec.adapt.trainers import QV, make_trainer
from evospec.adapt.trajectory import Trajectory
from evospec.adapt.unroll import collate, draft_support_logits, unroll
from evospec.models.eagle import clone_head, new_eagle_for
from tests.decoding.spec_helpers import tiny_target

D, V, K = 32, 64, 8


@pytest.fixture(scope="module")
def target():
    return tiny_target(1)


def setup(target, mode: str, **cfg):
    head = new_eagle_for(target, seed=2)
    pristine = {n: p.detach().clone() for n, p in head.named_parameters()}
    cfg = AdaptConfig(mode=mode, rank=4, alpha=4, k_logit=K, **cfg)
    return head, make_trainer(head, pristine, target.lm_head.weight, cfg)


def synthetic(n: int, seed: int = 0) -> list[Trajectory]:
    """Trajectories whose target always puts its mass on support slot 0 (a fixed id per step)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s = 3
        ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(s)])  # [s, K]
        logits = torch.full((s, K), -4.0)
        logits[:, 0] = 4.0
        out.append(
            Trajectory(
                ctx_features=torch.randn(6, D, generator=gen),
                ctx_tokens=torch.randint(0, V, (6,), generator=gen),
                tokens=ids[:, 0].clone(),
                support_ids=ids,
                support_logits=logits,
                target_index=torch.zeros(s, dtype=torch.long),
                in_vocab=torch.ones(s, dtype=torch.bool),
                rejected=torch.zeros(s, dtype=torch.bool),
            )
        )
    return out


@pytest.mark.parametrize(("mode", "lr"), [("clora", 3e-2), ("osd", 3e-3)])  # OSD moves every weight
def test_repeated_exposure_raises_draft_agreement(target, mode, lr):
    _head, tr = setup(target, mode, lr=lr, beta=0.3)
    batch = collate(synthetic(8))
    admitted = batch.step_valid

    def stats():
        with torch.no_grad():
            logits = draft_support_logits(tr.module, tr.lm_head, batch)
        kl = retained_kl(batch.support_logits, logits, 1.0).mean()
        agree = (logits.argmax(-1) == 0).float().mean()
        return float(kl), float(agree)

    kl0, agree0 = stats()
    for _ in range(40):
        assert tr.step(batch, admitted).ok
    kl1, agree1 = stats()
    assert kl1 < 0.5 * kl0
    assert agree1 > agree0 + 0.3 and agree1 > 0.8


def test_lora_publishes_merged_weights_that_reproduce_the_shadow(target):
    head, tr = setup(target, "clora", lr=5e-2)
    batch = collate(synthetic(4))
    for _ in range(3):
        assert tr.step(batch, batch.step_valid).ok
    weights = tr.serving_weights()
    assert set(weights) == set(QV)
    serving = clone_head(head)
    with torch.no_grad():
        for name, w in weights.items():
            serving.get_parameter(name).copy_(w)
        torch.testing.assert_close(unroll(serving, batch), unroll(tr.module, batch), atol=1e-5, rtol=1e-4)
        # and the update really moved them
        assert not torch.allclose(unroll(head, batch), unroll(tr.module, batch))


def test_lora_init_follows_the_adapt_seed_not_the_global_rng(target):
    def run(seed: int, global_seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(global_seed)
        _head, tr = setup(target, "clora", lr=5e-2, seed=seed)
        batch = collate(synthetic(4))
        for _ in range(2):
            assert tr.step(batch, batch.step_valid).ok
        return tr.adapter_tensors()

    a, b, c = run(0, 1), run(0, 2), run(1, 1)
    assert a.keys() == c.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0)  # same seed: same trajectory
    assert all(not torch.equal(a[n], c[n]) for n in a if "lora_A" in n)  # another seed: another init
    _head, fresh = setup(target, "clora", seed=3)
    for name, t in fresh.adapter_tensors().items():
        if "lora_B" in name:
            assert not t.any()  # B = 0: a fresh adapter leaves the head unchanged
        else:  # peft's init, kaiming-uniform(a = sqrt(5)) on A [r, D]: U(-1/sqrt(D), 1/sqrt(D))
            assert float(t.abs().max()) <= D**-0.5 and float(t.std()) > 0.4 * D**-0.5


def test_lora_shares_the_frozen_weights_and_trains_only_adapters(target):
    head, tr = setup(target, "clora")
    names = {n for n, p in tr.module.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert tr.module.fc.weight.data_ptr() == head.fc.weight.data_ptr()  # shared, not copied
    own_q = tr.module.layers[0].self_attn.q_proj.base_layer.weight
    assert own_q.data_ptr() != head.get_parameter(QV[0]).data_ptr()  # q/v: the shadow's own base


def test_nonfinite_loss_is_discarded_and_weights_stay(target):
    _head, tr = setup(target, "clora", lr=1e-1)
    trajs = synthetic(2)
    trajs[0].support_logits[0, 0] = float("nan")
    batch = collate(trajs)
    before = {n: w.clone() for n, w in tr.serving_weights().items()}
    res = tr.step(batch, batch.step_valid)
    assert not res.ok and res.reason == "nonfinite-loss"
    for n, w in tr.serving_weights().items():
        assert torch.equal(w, before[n])


@pytest.mark.parametrize("steps", [1, 3])
def test_kl_blowup_is_discarded_all_or_nothing(target, steps):
    _head, tr = setup(target, "osd", lr=1e-1, max_loss=1e-3, steps_per_update=steps)
    batch = collate(synthetic(2))
    before = tr.serving_weights()
    res = tr.step(batch, batch.step_valid)
    assert not res.ok and res.reason == "blowup"
    for n, w in tr.serving_weights().items():
        assert torch.equal(w, before[n])


def test_lora_state_is_far_smaller_than_osd(target):
    batch = collate(synthetic(2))
    sizes = {}
    for mode in ("clora", "osd"):
        _, tr = setup(target, mode)
        tr.step(batch, batch.step_valid)
        sizes[mode] = sum(tr.aux_bytes().values())
        aux = tr.aux_bytes()
        assert aux["optimizer"] == 2 * aux["trainable"] + 4 * len(tr.params)  # m, v and the step count
    assert sizes["clora"] < 0.75 * sizes["osd"]


def test_adapter_tensors_round_trip(target):
    _head, tr = setup(target, "clora", lr=5e-2)
    batch = collate(synthetic(2))
    tr.step(batch, batch.step_valid)
    saved = tr.adapter_tensors()
    _, fresh = setup(target, "clora")
    fresh.load_adapter_tensors(saved)
    for n, w in fresh.serving_weights().items():
        torch.testing.assert_close(w, tr.serving_weights()[n])
    with pytest.raises(ValueError):
        fresh.load_adapter_tensors({"nope": torch.zeros(1)})


def test_aux_bytes_waits_for_a_step_in_progress(target):
    """The admin state's byte counts never read grads a worker's backward is replacing."""
    import threading

    _head, tr = setup(target, "clora")
    batch = collate(synthetic(2))
    inside, release, read = threading.Event(), threading.Event(), []
    step = tr._step

    def slow_step(*args):
        inside.set()
        release.wait(30)
        return step(*args)

    tr._step = slow_step
    worker = threading.Thread(target=tr.step, args=(batch, batch.step_valid))
    worker.start()
    assert inside.wait(30)
    reader = threading.Thread(target=lambda: read.append(tr.aux_bytes()))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not read  # blocked while the step runs
    release.set()
    worker.join(30)
    reader.join(30)
    assert read and read[0]["grads"] == read[0]["trainable"]  # counted after the step: its grads exist

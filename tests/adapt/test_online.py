"""The online adapter inside the decode loop: lossless, asynchronous, recoverable."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest
import torch

from evospec.adapt.config import AdaptConfig
from evospec.adapt.online import OnlineAdapter
from evospec.decoding.methods import METHOD_SPECS, make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from tests.decoding.spec_helpers import ar_tokens, prompt_of, tiny_target
from tests.vocab.helpers import SMALL, stand_in_indices

V = 64
EOS = (V - 1,)
TREE = TreeConfig(top_k=4, depth=4, total_tokens=12)
# small and eager: updates happen every few rounds, and move the weights visibly
FAST = AdaptConfig(buffer_size=4, lr=1e-2, context=8, k_logit=16, rank=4, alpha=4)


def decoder(target, head, method, **cfg):
    """``method``'s decoder with the fast adaptation settings; an EAGLE-3 method gets a random
    full-vocabulary EAGLE-3 head for ``target`` instead of ``head``."""
    from evospec.models.eagle3 import new_eagle3_for

    adapt = AdaptConfig(**{**FAST.__dict__, **cfg})
    if METHOD_SPECS[method].head == "eagle3":
        head = new_eagle3_for(target, seed=2)
    return make_decoder(
        method,
        target,
        draft=head,
        tree=TREE,
        vocab=SMALL,
        indices=stand_in_indices(target),
        eos_ids=EOS,
        adapt=adapt,
    )


@pytest.mark.parametrize("asynchronous", [False, True], ids=["inline", "async"])
@pytest.mark.parametrize("method", [s.name for s in METHOD_SPECS.values() if s.adapt])
def test_greedy_output_equals_ar_while_updates_run(target, head, method, asynchronous):
    dec = decoder(target, head, method, asynchronous=asynchronous)
    params = SamplingParams(max_new_tokens=40)
    try:
        for i in range(4):
            prompt = prompt_of(i, 12)
            got = [t for ev in dec.generate(prompt, params) for t in ev.tokens]
            assert got == ar_tokens(target, prompt, params, eos=EOS)
        assert dec.adapt.wait_idle()
        st = dec.adapt.state()
        assert st["updates"] >= 2 and st["errors"] == 0
        assert st["serving"]["version"] >= 1  # published weights were served
    finally:
        dec.adapt.close()


def test_the_shared_draft_head_is_never_modified(target, head):
    before = {n: p.clone() for n, p in head.named_parameters()}
    dec = decoder(target, head, "clora", asynchronous=False)
    list(dec.generate(prompt_of(0, 12), SamplingParams(max_new_tokens=40)))
    assert dec.adapt.stats.updates >= 1
    for n, p in head.named_parameters():
        assert torch.equal(p, before[n])
    served = dec.drafter.head.get_parameter("layers.0.self_attn.q_proj.weight")
    assert not torch.equal(served, before["layers.0.self_attn.q_proj.weight"])


def test_weights_change_only_between_rounds(target, head):
    """A version published mid-round is copied at the next round's start, never inside one."""
    dec = decoder(target, head, "clora", asynchronous=False)
    q = dec.drafter.head.get_parameter("layers.0.self_attn.q_proj.weight")
    seen = []
    orig_expand = dec.drafter.expand

    def spy(*a, **kw):
        seen.append((dec.adapt._serving[1], q.clone()))
        return orig_expand(*a, **kw)

    dec.drafter.expand = spy
    list(dec.generate(prompt_of(1, 12), SamplingParams(max_new_tokens=40)))
    by_version: dict[int, torch.Tensor] = {}
    for version, w in seen:
        assert torch.equal(by_version.setdefault(version, w), w)  # one weight set per served version
    assert len(by_version) >= 2


def test_a_failing_update_keeps_the_previous_adapter(target, head):
    dec = decoder(target, head, "clora", asynchronous=True)
    params = SamplingParams(max_new_tokens=40)
    try:
        list(dec.generate(prompt_of(0, 12), params))
        assert dec.adapt.wait_idle()
        good = dec.adapt.versions()[""]
        assert good >= 1
        st = dec.adapt._states[""]
        weights = {n: w.clone() for n, w in st.front.items()}  # version ``good``'s serving weights
        st.trainer.step = lambda *a, **k: (_ for _ in ()).throw(FloatingPointError("injected"))
        prompt = prompt_of(5, 12)
        got = [t for ev in dec.generate(prompt, params) for t in ev.tokens]
        assert got == ar_tokens(target, prompt, params, eos=EOS)
        assert dec.adapt.wait_idle()
        assert dec.adapt.stats.errors >= 1
        assert dec.adapt.versions()[""] == good
        assert dec.adapt.state()["serving"]["version"] == good
        for n, w in weights.items():
            assert torch.equal(dec.drafter.head.get_parameter(n), w)
    finally:
        dec.adapt.close()


def test_discarded_updates_are_counted(target, head):
    dec = decoder(target, head, "osd", asynchronous=False, max_loss=1e-6)
    list(dec.generate(prompt_of(0, 12), SamplingParams(max_new_tokens=40)))
    st = dec.adapt.state()
    assert st["updates"] == 0 and st["discarded"] >= 1
    assert st["discard_reasons"] == {"blowup": st["discarded"]}
    assert st["serving"]["version"] == 0


def test_save_load_and_reset(target, head, tmp_path):
    dec = decoder(target, head, "clora", asynchronous=False)
    list(dec.generate(prompt_of(0, 12), SamplingParams(max_new_tokens=40)))
    trained = {n: p.clone() for n, p in dec.drafter.head.named_parameters()}
    path = dec.adapt.save(tmp_path / "a.safetensors")

    dec.adapt.reset()
    for n, p in dec.drafter.head.named_parameters():
        assert torch.equal(p, head.get_parameter(n))  # back to the base head

    fresh = decoder(target, head, "clora", asynchronous=False)
    info = fresh.adapt.load(path)
    assert info["version"] == 1
    for n, p in fresh.drafter.head.named_parameters():
        torch.testing.assert_close(p, trained[n])

    osd = decoder(target, head, "osd", asynchronous=False)
    with pytest.raises(ValueError, match="clora adapter cannot load into a osd"):
        osd.adapt.load(path)
    other = decoder(target, head, "clora", asynchronous=False, rank=2, alpha=2)
    with pytest.raises(ValueError, match="rank"):
        other.adapt.load(path)
    with pytest.raises(FileNotFoundError):
        fresh.adapt.load(tmp_path / "missing.safetensors")


def test_keys_keep_separate_adapters_with_lru_eviction(target, head):
    dec = decoder(target, head, "clora", asynchronous=False, max_keys=2)
    params = SamplingParams(max_new_tokens=30)
    ad = dec.adapt
    ad.select("alice")
    list(dec.generate(prompt_of(0, 12), params))
    alice = {n: p.clone() for n, p in dec.drafter.head.named_parameters()}
    ad.select("bob")  # bob has no adapter yet: the base head serves
    for n, p in dec.drafter.head.named_parameters():
        assert torch.equal(p, head.get_parameter(n))
    list(dec.generate(prompt_of(1, 12), params))
    ad.select("alice")  # alice's weights come back
    for n, p in dec.drafter.head.named_parameters():
        assert torch.equal(p, alice[n])
    assert set(ad.versions()) == {"alice", "bob"}
    ad.select("carol")
    list(dec.generate(prompt_of(2, 12), params))
    assert set(ad.versions()) == {"bob", "carol"}  # alice was least recently used


def test_a_full_queue_drops_rounds_without_blocking(target, head):
    import threading

    dec = decoder(target, head, "clora", asynchronous=True, max_pending=1)
    ad: OnlineAdapter = dec.adapt
    release = threading.Event()
    process = ad._process
    ad._process = lambda trajs: (release.wait(30), process(trajs))  # a stalled worker
    params = SamplingParams(max_new_tokens=40)
    try:
        got = [t for ev in dec.generate(prompt_of(3, 12), params) for t in ev.tokens]
        assert got == ar_tokens(target, prompt_of(3, 12), params, eos=EOS)
        assert ad.stats.dropped >= 1
        assert ad.stats.trajectories == ad.stats.dropped + 2  # one held by the worker, one queued
    finally:
        release.set()
        ad.close()


def test_sampling_follows_the_target_while_the_draft_learns():
    """The second generated token keeps the target's marginal while updates land between
    requests (inline updates every few rounds, so the draft really changes during the run)."""
    from tests.decoding.spec_helpers import chi2_pvalue, exact_second_token, sampled_second_tokens

    target = tiny_target(4, sharp=3.0)
    head = new_eagle_for(target, seed=2)
    dec = make_decoder(
        "clora",
        target,
        draft=head,
        tree=TreeConfig(top_k=3, depth=3, total_tokens=8),
        vocab=replace(SMALL, frspec_k=V),  # every id active: no step goes to the vocabulary path
        indices=stand_in_indices(target),
        adapt=replace(FAST, asynchronous=False, buffer_size=2),
    )
    prompt = prompt_of(8, 5)
    exact = exact_second_token(target, prompt, temperature=1.0).float()
    counts, accepted = sampled_second_tokens(dec, prompt, 1.0, n=800)
    assert dec.adapt.stats.updates > 50  # the draft changed many times during the run
    assert accepted > 0
    assert chi2_pvalue(counts, exact) > 1e-3


def test_publish_lag_counts_rounds_served_on_older_weights(target, head):
    import threading

    params = SamplingParams(max_new_tokens=40)
    inline = decoder(target, head, "clora", asynchronous=False)
    list(inline.generate(prompt_of(4, 12), params))
    assert inline.adapt.stats.updates >= 2
    assert inline.adapt.state()["publish_lag_rounds"] == {"median": 0, "p90": 0, "max": 0}

    dec = decoder(target, head, "clora", asynchronous=True)
    ad: OnlineAdapter = dec.adapt
    release = threading.Event()
    process = ad._process
    ad._process = lambda trajs: (release.wait(30), process(trajs))  # a worker one request behind
    try:
        rounds = sum(not ev.prefill for ev in dec.generate(prompt_of(4, 12), params))
        assert ad.stats.publish_lag == deque()  # nothing published while the worker was stalled
        release.set()
        assert ad.wait_idle()
        learned_to = ad._states[""].front_round  # the newest round the last update learned from
        assert ad.stats.updates >= 2 and 0 <= learned_to < rounds
        list(dec.generate(prompt_of(5, 12), params))  # the same key: served at its first round
        assert ad.stats.publish_lag[0] == rounds - 1 - learned_to  # rounds served on older weights
        assert ad.state()["publish_lag_rounds"]["max"] >= ad.stats.publish_lag[0]
    finally:
        release.set()
        ad.close()


def test_a_backlog_still_updates_every_buffer(target):
    """A worker that fell behind gates many rounds at once; it still updates every B admitted steps."""
    from tests.adapt.test_trainers import synthetic

    ad = OnlineAdapter(
        new_eagle_for(target, seed=1),
        target.lm_head.weight,
        replace(FAST, asynchronous=False, gate_kl=0.0, k_logit=8),
    )
    ad._process(synthetic(12))  # 12 rounds of 3 verified steps, all admitted (KL > 0)
    assert ad.stats.admitted == 36 and ad.stats.discarded == 0
    assert ad.stats.updates == 6  # B = 4: every second round fills the buffer
    assert ad.buffered() == 0


def test_the_update_thread_leaves_the_decode_threads_cores_alone(target, head):
    """The worker runs its updates on one intra-op thread; the decode thread keeps its own count."""
    import threading

    before = torch.get_num_threads()
    dec = decoder(target, head, "clora", asynchronous=True)
    seen = []
    process = dec.adapt._process
    dec.adapt._process = lambda batch: seen.append(torch.get_num_threads()) or process(batch)
    for seed in range(3):
        list(dec.generate(prompt_of(seed, 8), SamplingParams(max_new_tokens=24)))
    assert dec.adapt.wait_idle()
    assert seen and set(seen) == {1}  # updates ran, each on one intra-op thread
    assert torch.get_num_threads() == before  # not the decode thread's
    assert threading.current_thread() is threading.main_thread()
    dec.close()

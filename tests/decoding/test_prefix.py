"""Prefix reuse (decoding/prefix.py): a decoder's next prompt keeps the slots it shares with
the last sequence, and every method's output stays what it is from an empty cache."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.methods import make_decoder
from evospec.decoding.prefix import PrefixCache, common_prefix
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats
from evospec.decoding.tree import TreeConfig
from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.eagle import new_eagle_for
from evospec.models.eagle3 import new_eagle3_for
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import ar_tokens, prompt_of, tiny_target

needs_ops = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)
CHAIN = TreeConfig(top_k=1, depth=2, total_tokens=2, lookup=3, lookup_ngram=1)
TREE = TreeConfig(top_k=3, depth=3, total_tokens=8)


def _target(seed: int = 0, family: str = "llama"):
    """A tiny int4 target on the fused ops with real-sized attention rows (row-exact forwards);
    Gemma-3's has a 6-token sliding window."""
    model = tiny_target(seed, head_dim=64, ctx=256, family=family)
    quantize_linears(model, "int4")
    model.exact_rows = True
    assert enable_fused_ops(model)
    model.step_graph = StepGraph(model)
    return model


def _decoder(method: str, target, tree=CHAIN):
    if method == "ar":
        return make_decoder("ar", target)
    if method == "ngram":
        return make_decoder("ngram", target, tree=tree)
    if method == "eagle3":
        return make_decoder("eagle3", target, draft=new_eagle3_for(target, aux_layers=(0, 1, 1)), tree=tree)
    return make_decoder("eagle2", target, draft=new_eagle_for(target, seed=3), tree=tree)


def _run(dec, prompt, params) -> tuple[list[int], RequestStats]:
    stats = RequestStats()
    tokens = []
    for ev in dec.generate(prompt, params):
        stats.add(ev)
        tokens += ev.tokens
    return tokens, stats


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


@needs_ops
def test_reusable_counts_the_shared_prefix_and_leaves_a_token_to_prefill():
    cache = PrefixCache(_target())
    cache.tokens = [5, 6, 7, 8]
    assert cache.reusable([5, 6, 7, 8, 9]) == 4
    assert cache.reusable([5, 6, 7, 8]) == 3  # the last prompt token is always prefilled
    assert cache.reusable([5, 6, 1, 2]) == 2
    assert cache.reusable([9]) == 0
    assert not PrefixCache(tiny_target(0)).enabled  # fp32 linears, SDPA prefill: not row-exact


@needs_ops
@pytest.mark.parametrize("method", ["ar", "ngram", "eagle2", "eagle3"])
@pytest.mark.parametrize("tree", [CHAIN, TREE], ids=["chain+lookup", "tree"])
def test_a_conversation_reuses_its_turns_and_every_answer_equals_a_fresh_one(method, tree):
    if method in ("ar", "ngram") and tree is TREE:
        pytest.skip("no drafted tree")
    target = _target(1)
    dec = _decoder(method, target, tree)
    params = SamplingParams(max_new_tokens=14)
    prompt = prompt_of(1, 11)
    expected = 0
    for turn in range(4):
        got, stats = _run(dec, prompt, params)
        assert got == ar_tokens(target, prompt, params), turn  # AR from an empty cache
        assert stats.cached_tokens == expected
        expected = len(prompt) + len(got) - 1  # what the next turn keeps: all but the last token
        prompt = [*prompt, *got, *prompt_of(10 + turn, 4)]


@needs_ops
@pytest.mark.parametrize("method", ["ar", "ngram", "eagle2"])
def test_a_gemma_conversation_reuses_its_turns_past_the_window_and_equals_fresh_answers(method):
    target = _target(4, family="gemma3")
    dec = _decoder(method, target)
    params = SamplingParams(max_new_tokens=10)
    prompt = prompt_of(5, 9)
    expected = 0
    for turn in range(3):
        got, stats = _run(dec, prompt, params)
        assert got == ar_tokens(target, prompt, params), turn
        assert stats.cached_tokens == expected
        expected = len(prompt) + len(got) - 1
        prompt = [*prompt, *got, *prompt_of(20 + turn, 3)]


@needs_ops
@pytest.mark.parametrize("method", ["ar", "eagle2"])
def test_sampling_with_reused_slots_draws_what_a_fresh_cache_draws(method):
    target = _target(2)
    first = prompt_of(3, 9)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7)
    dec = _decoder(method, target)
    head, _ = _run(dec, first, SamplingParams(max_new_tokens=6))
    follow = [*first, *head, 3, 4]
    reused, stats = _run(dec, follow, params)
    fresh_dec = _decoder(method, target)
    fresh, fresh_stats = _run(fresh_dec, follow, params)
    assert stats.cached_tokens == len(first) + len(head) - 1 and fresh_stats.cached_tokens == 0
    assert reused == fresh


@needs_ops
@pytest.mark.parametrize("seed", range(3))
def test_reused_slots_hold_what_a_fresh_prefill_writes(seed):
    """Bitwise: K/V and the kept features of a prompt + answer equal one prefill of them
    (fails with SDPA prefills: a prefill's rows then round otherwise than decoding's)."""
    target = _target(3 + seed)
    dec = _decoder("eagle2", target)
    first = prompt_of(4 + seed, 40)
    out, _ = _run(dec, first, SamplingParams(max_new_tokens=30))
    follow = [*first, *out, 7]
    n = dec.prefix.reusable(follow)
    assert n == len(first) + len(out) - 1  # all but the last emitted token
    fresh = target.new_cache(n + 1)
    ref = target(torch.tensor([follow[:n]]), torch.arange(n), fresh, logits="none")
    assert torch.equal(dec.cache.k[:, :, :, :n], fresh.k[:, :, :, :n])
    assert torch.equal(dec.cache.v[:, :, :, :n], fresh.v[:, :, :, :n])
    assert torch.equal(dec.prefix.features[:n], ref.hidden[0])


@needs_ops
def test_a_diverging_prompt_keeps_only_the_shared_part_and_a_cancelled_request_its_tokens():
    target = _target(4)
    dec = _decoder("eagle2", target)
    params = SamplingParams(max_new_tokens=12)
    first = prompt_of(5, 10)
    _run(dec, first, params)
    edited = [*first[:6], *prompt_of(6, 5)]  # the user edited an earlier message
    got, stats = _run(dec, edited, params)
    assert stats.cached_tokens == 6 and got == ar_tokens(target, edited, params)
    # a request closed after its first round (client gone) leaves the tokens it emitted
    gen = dec.generate(edited, params)
    emitted = next(gen).tokens + next(gen).tokens
    gen.close()
    assert dec.prefix.tokens == [*edited, *emitted[:-1]]
    again, stats = _run(dec, [*edited, *emitted, 9], params)
    assert again == ar_tokens(target, [*edited, *emitted, 9], params)
    assert stats.cached_tokens == len(edited) + len(emitted) - 1


@needs_ops
def test_a_failed_request_forgets_the_cache(monkeypatch):
    target = _target(5)
    dec = _decoder("ar", target)
    prompt = prompt_of(6, 8)
    _run(dec, prompt, SamplingParams(max_new_tokens=4))
    assert dec.prefix.tokens
    calls = {"n": 0}
    real = type(target).forward

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(self, *a, **k)

    monkeypatch.setattr(type(target), "forward", failing)
    with pytest.raises(RuntimeError):
        _run(dec, [*prompt, 1, 2], SamplingParams(max_new_tokens=6))
    assert dec.prefix.tokens == []


def test_models_without_row_exact_forwards_never_reuse():
    target = tiny_target(0)  # fp32: SDPA prefill
    dec = make_decoder("ar", target)
    prompt = prompt_of(7, 8)
    out, _ = _run(dec, prompt, SamplingParams(max_new_tokens=5))
    _, stats = _run(dec, [*prompt, *out, 1], SamplingParams(max_new_tokens=5))
    assert stats.cached_tokens == 0


@needs_ops
def test_reuse_can_be_turned_off():
    target = _target(6)
    dec = make_decoder("ar", target, reuse_prefix=False)
    prompt = prompt_of(8, 8)
    out, _ = _run(dec, prompt, SamplingParams(max_new_tokens=5))
    again, stats = _run(dec, [*prompt, *out, 1], SamplingParams(max_new_tokens=5))
    assert stats.cached_tokens == 0 and again == ar_tokens(
        target, [*prompt, *out, 1], SamplingParams(max_new_tokens=5)
    )


def _small_store(dec, mb: int = 64):
    dec.prefix.store_bytes, dec.prefix.min_snapshot, dec.prefix.min_gain = mb << 20, 8, 4
    return dec


@needs_ops
@pytest.mark.parametrize("method", ["ar", "eagle2", "eagle3"])
def test_alternating_prompts_each_get_their_slots_back_from_the_store(method):
    """Two long prompts in turn: each request after the first two restores its sequence's
    slots (and features) from the snapshot kept when the other overwrote them; every output
    is AR's from an empty cache."""
    target = _target(5)
    dec = _small_store(_decoder(method, target))
    params = SamplingParams(max_new_tokens=10)
    docs = [prompt_of(20, 30), prompt_of(21, 30)]
    answers = {}
    for i, doc in enumerate(docs):  # fills the live cache, then the store
        got, stats = _run(dec, doc, params)
        assert stats.cached_tokens == 0 and got == ar_tokens(target, doc, params)
        answers[i] = got
    assert [len(s.tokens) for s in dec.prefix.store] == [len(docs[0]) + len(answers[0]) - 1]
    for turn in range(4):
        i = turn % 2
        follow = [*docs[i], *answers[i], *prompt_of(30 + turn, 3)]
        got, stats = _run(dec, follow, params)
        assert got == ar_tokens(target, follow, params), turn
        assert stats.cached_tokens == len(docs[i]) + len(answers[i]) - 1, turn
        docs[i], answers[i] = follow, got


@needs_ops
def test_the_store_keeps_what_fits_least_recently_used_out_first_and_can_be_off():
    target = _target(6)
    params = SamplingParams(max_new_tokens=4)
    prompts = [prompt_of(40 + i, 24) for i in range(3)]
    dec = _small_store(_decoder("ar", target))
    for p in prompts:
        _run(dec, p, params)
    one = dec.prefix.store[0].nbytes
    assert len(dec.prefix.store) == 2  # the first two, the third is live
    dec.prefix.store_bytes = one  # room for one: a new snapshot drops the oldest
    _run(dec, prompt_of(50, 24), params)
    assert [s.tokens[:24] for s in dec.prefix.store] == [tuple(prompts[2])]
    off = _small_store(_decoder("ar", target), mb=0)
    for p in [*prompts, prompts[0]]:
        _, stats = _run(off, p, params)
    assert off.prefix.store == [] and stats.cached_tokens == 0


@needs_ops
def test_batched_sequences_lend_and_remember_slots_of_the_store():
    """lend copies a prompt's longest shared run (the live cache's or a snapshot's) into another
    cache and leaves the live one alone; remember keeps another cache's slots as a K/V-only
    snapshot, not for a drafted decoder; a request reusing such a snapshot still decodes as AR."""
    target = _target(7)
    dec = _decoder("ar", target)
    dec.prefix.min_snapshot = dec.prefix.min_gain = 4
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = prompt_of(1, 30)
    _run(dec, first, params)  # the live cache now holds `first` and its answer but the last token
    live_tokens = list(dec.prefix.tokens)
    dst = target.new_cache(64)
    assert dec.prefix.lend([*first[:20], 99, 98], dec.cache, dst) == 20
    assert torch.equal(dst.k[:, :, :, :20], dec.cache.k[:, :, :, :20]) and dst.length == 20
    assert dec.prefix.tokens == live_tokens  # the live cache's bookkeeping is unchanged
    assert dec.prefix.lend([5], dec.cache, dst) == 0 and dst.length == 0

    # another sequence's cache, remembered, then lent to a prompt that extends it
    other = prompt_of(2, 12)
    other_cache = target.new_cache(64)
    target(torch.tensor([other]), torch.arange(12), other_cache, logits="none")
    dec.prefix.remember(other, other_cache)
    assert any(s.tokens == tuple(other) and s.features is None for s in dec.prefix.store)
    assert dec.prefix.lend([*other, 7, 8], dec.cache, dst) == 12
    assert torch.equal(dst.v[:, :, :, :12], other_cache.v[:, :, :, :12])
    tokens, stats = _run(dec, [*other, 7, 8], params)  # the decoder's own prepare takes it too
    assert stats.cached_tokens == 12
    assert tokens == ar_tokens(target, [*other, 7, 8], params)

    drafted = _decoder("eagle2", target)
    assert drafted.prefix.needs_features
    drafted.prefix.remember(other, other_cache)
    assert not drafted.prefix.store  # its snapshots must carry features


@needs_ops
def test_a_benchmarks_warm_up_leaves_no_prompt_cached_for_the_timed_runs():
    """The side-by-side runner warms each decoder up on the first prompt; its prefix cache would
    keep it, and the first timed run would skip most of its prefill. It forgets it instead."""
    from evospec.bench.prompts import BenchPrompt
    from evospec.bench.runner import run_side_by_side

    target = _target(1)
    decoders = {"ar": _decoder("ar", target), "ngram": _decoder("ngram", target)}
    prompts = [BenchPrompt("a", "x", True), BenchPrompt("b", "y", True)]
    ids = {"x": prompt_of(1, 11), "y": prompt_of(2, 9)}
    records = run_side_by_side(
        decoders, prompts, lambda p: ids[p.text], SamplingParams(max_new_tokens=6), progress=False
    )
    assert [r.stats.cached_tokens for r in records] == [0, 0, 0, 0]
    _run(decoders["ar"], ids["y"], SamplingParams(max_new_tokens=6))  # reuse itself still works:
    assert _run(decoders["ar"], ids["y"], SamplingParams(max_new_tokens=6))[1].cached_tokens > 0

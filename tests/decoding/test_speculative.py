"""The speculative round loop is lossless: greedy output equals plain decoding everywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evospec.decoding.drafter import TargetDrafter
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.packing import pack_linears
from evospec.models.step import StepGraph, supports_step_graph
from tests.decoding.spec_helpers import (
    ar_tokens,
    chi2_pvalue,
    eagle_drafter,
    exact_second_token,
    perturbed_drafter,
    prompt_of,
    spec_events,
    spec_tokens,
    tiny_target,
)

TREES = (TreeConfig(top_k=4, depth=4, total_tokens=12), TreeConfig(top_k=3, depth=2, total_tokens=5))
CHAIN = TreeConfig(top_k=1, depth=3, total_tokens=3)  # what --tree auto picks on a CPU
STOPPING = TreeConfig(top_k=1, depth=4, total_tokens=4, min_prob=0.4)  # a chain sized by its confidence


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def drafters(target):
    return {
        "eagle-random": eagle_drafter(target),
        "perturbed": perturbed_drafter(target, noise=0.6),
        "perfect": TargetDrafter(target),
    }


@pytest.mark.parametrize("tree", [*TREES, STOPPING], ids=["k4d4t12", "k3d2t5", "stopping4"])
@pytest.mark.parametrize("name", ["eagle-random", "perturbed", "perfect"])
@pytest.mark.parametrize("seed", range(9))
def test_greedy_equals_ar(target, drafters, name, tree, seed):
    """3 drafters x 2 trees x 9 prompts = 54 prompt/seed combinations."""
    prompt = prompt_of(seed, 3 + 2 * seed)
    params = SamplingParams(max_new_tokens=24)
    assert spec_tokens(target, drafters[name], prompt, params, tree) == ar_tokens(target, prompt, params)


def _quantised_target(seed: int, fmt: str, fused: bool = True, **kw):
    """A tiny target with ``fmt`` weights and row-exact verification, as CPU models load
    (``fused``: with the fused CPU ops, where they build)."""
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import kernels_available, quantize_linears

    if not kernels_available(fmt):
        pytest.skip(f"torch without CPU {fmt} kernels")
    target = tiny_target(seed, **kw)
    quantize_linears(target, fmt)
    target.exact_rows = True
    if fused and not enable_fused_ops(target):
        pytest.skip("the fused CPU ops do not build here")
    if supports_step_graph(target):
        target.step_graph = StepGraph(target)  # steps and chains run recorded graphs
    return target


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "aten"])
@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
@pytest.mark.parametrize("tree", [*TREES, CHAIN, STOPPING], ids=["k4d4t12", "k3d2t5", "chain3", "stopping4"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_ar_on_a_quantised_target(fmt, tree, seed, fused):
    """Quantised weights (bf16 activations at every matmul) amplify any rounding difference
    between verifying n tokens and decoding one; row-exact verification leaves none, with
    the fused CPU ops as with plain aten ops."""
    target = _quantised_target(6, fmt, fused)
    drafter = perturbed_drafter(target, noise=0.6, seed=seed)
    prompt = prompt_of(seed, 4 + 3 * seed)
    params = SamplingParams(max_new_tokens=24)
    assert spec_tokens(target, drafter, prompt, params, tree) == ar_tokens(target, prompt, params)


@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_ar_on_a_packed_target(seed):
    """oneDNN-packed linears (the default for loaded CPU models): verification of many tree
    tokens and one-token decoding run other kernels, yet the output is still AR's."""
    target = tiny_target(1)
    if pack_linears(target) == 0:
        pytest.skip("torch built without oneDNN")
    drafter = perturbed_drafter(target, noise=0.6, seed=seed)
    prompt = prompt_of(seed, 4 + 3 * seed)
    params = SamplingParams(max_new_tokens=24)
    assert spec_tokens(target, drafter, prompt, params, TREES[0]) == ar_tokens(target, prompt, params)


def test_perturbed_drafter_accepts_some_but_not_all(target, drafters):
    """Guards the test above: the perturbed draft really exercises partial acceptance."""
    evs = spec_events(
        target, drafters["perturbed"], prompt_of(1, 6), SamplingParams(max_new_tokens=40), TREES[0]
    )
    accepted = [ev.accepted for ev in evs if not ev.prefill]
    assert 0 < sum(accepted) < len(accepted) * TREES[0].depth


def test_a_perfect_draft_sampling_its_chain_is_accepted_where_proposing_is_not():
    """Under sampling, a chain drawn from the target's own distribution passes the ratio test
    (up to the rounding between the draft head's log-softmax and the target's logits); the same
    draft proposing its most likely tokens is accepted only with their probability."""
    target = tiny_target(0, sharp=1.5)
    prompt, tree = prompt_of(5, 6), TreeConfig(top_k=1, depth=3, total_tokens=3)
    rates = {}
    for sample in (True, False):
        accepted = drafted = 0
        for seed in range(6):
            params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed)
            evs = spec_events(
                target, TargetDrafter(target), prompt, params, replace(tree, sample_drafts=sample)
            )
            accepted += sum(ev.accepted for ev in evs if not ev.prefill)
            drafted += sum(ev.tree_size for ev in evs if not ev.prefill)
        rates[sample] = accepted / drafted
    assert rates[True] > 0.97, rates
    assert rates[False] < 0.8, rates


@pytest.mark.parametrize("top_k,sharp", [(1, 6.0), (3, 40.0)])
def test_perfect_draft_accepts_every_drafted_token(top_k, sharp):
    """With the target drafting for itself every round accepts ``depth`` tokens (+1 bonus).

    The greedy chain is guaranteed to be in an EAGLE-2 tree only when it is also the best
    cumulative path: with top_k 1, or when the target's choices are near-certain.
    """
    target = tiny_target(0, sharp=sharp)
    tree = TreeConfig(top_k=top_k, depth=5, total_tokens=40)
    evs = spec_events(target, TargetDrafter(target), prompt_of(3, 7), SamplingParams(max_new_tokens=31), tree)
    rounds = [ev for ev in evs if not ev.prefill]
    assert len(rounds) == 5
    assert all(ev.accepted == tree.depth for ev in rounds)
    assert all(len(ev.tokens) == tree.depth + 1 for ev in rounds)
    assert all(ev.bonus == ev.tokens[-1] and ev.tree_size > 0 for ev in rounds)


@pytest.mark.parametrize("where", [1, 2, 3])
def test_eos_inside_accepted_path(target, where):
    """EOS drafted and accepted mid-path: output stops right after it, exactly as AR does."""
    prompt = prompt_of(11, 5)
    plain = ar_tokens(target, prompt, SamplingParams(max_new_tokens=20))
    eos = plain[1 + where]  # lands inside the first speculative round's accepted path
    expect = ar_tokens(target, prompt, SamplingParams(max_new_tokens=20), eos=(eos,))
    tree = TreeConfig(top_k=2, depth=5, total_tokens=20)
    evs = spec_events(
        target, TargetDrafter(target), prompt, SamplingParams(max_new_tokens=20), tree, eos=(eos,)
    )
    got = [t for ev in evs for t in ev.tokens]
    assert got == expect and got[-1] == eos and evs[-1].finish_reason == "stop"


def test_stop_ids_and_max_new_tokens_inside_path(target):
    prompt = prompt_of(12, 4)
    tree = TreeConfig(top_k=2, depth=5, total_tokens=20)
    for max_new in (1, 2, 4, 7):
        params = SamplingParams(max_new_tokens=max_new)
        evs = spec_events(target, TargetDrafter(target), prompt, params, tree)
        got = [t for ev in evs for t in ev.tokens]
        assert got == ar_tokens(target, prompt, params) and len(got) == max_new
        assert evs[-1].finish_reason == "length"
    plain = ar_tokens(target, prompt, SamplingParams(max_new_tokens=12))
    params = SamplingParams(max_new_tokens=12, stop_ids=frozenset({plain[4]}))
    got = spec_tokens(target, TargetDrafter(target), prompt, params, tree)
    assert got == ar_tokens(target, prompt, params) and got[-1] == plain[4]


@pytest.mark.parametrize("prompt_len", [150, 155, 158, 159])
def test_prompts_near_the_context_limit(target, drafters, prompt_len):
    prompt = prompt_of(prompt_len, prompt_len)
    params = SamplingParams(max_new_tokens=30)  # clipped to ctx - prompt_len
    expect = ar_tokens(target, prompt, params)
    assert len(expect) <= 160 - prompt_len
    for name in ("perfect", "perturbed"):
        assert spec_tokens(target, drafters[name], prompt, params, TREES[0]) == expect


def test_prompt_filling_the_context_is_rejected(target, drafters):
    with pytest.raises(ValueError, match="context window"):
        spec_tokens(target, drafters["perfect"], prompt_of(0, 160), SamplingParams(), TREES[0])


def test_gemma3_sliding_window_target_with_eagle_head():
    target = tiny_target(2, family="gemma3")
    drafter = eagle_drafter(target, seed=1)
    for seed in range(3):
        prompt = prompt_of(seed, 9)  # longer than the window of 6 once decoding starts
        params = SamplingParams(max_new_tokens=20)
        assert spec_tokens(target, drafter, prompt, params, TREES[0]) == ar_tokens(target, prompt, params)


def test_seeded_sampling_repeats_exactly(target, drafters):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=1234)
    first = spec_tokens(target, drafters["perturbed"], prompt_of(5, 6), params, TREES[0])
    again = spec_tokens(target, drafters["perturbed"], prompt_of(5, 6), params, TREES[0])
    other = spec_tokens(
        target,
        drafters["perturbed"],
        prompt_of(5, 6),
        SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=99),
        TREES[0],
    )
    assert first == again
    assert first != other  # different seeds give different samples (peaked but not deterministic)


@pytest.mark.parametrize(
    "fmt,chain,fused,filters",
    [
        ("fp32", False, False, {}),
        ("int4", False, True, {}),
        ("int4", True, True, {}),
        ("int4", True, False, {}),
        ("int4", "stopping", True, {}),
        ("int4", "proposed", True, {}),
        ("fp32", False, False, {"top_k": 12, "top_p": 0.8}),
        ("fp32", True, False, {"top_k": 12, "top_p": 0.8}),
    ],
)
def test_sampled_tokens_follow_the_target_end_to_end(fmt, chain, fused, filters):
    """The second generated token (drafted, accepted or resampled) has the target's marginal;
    on a chain the quantised target verifies through its recorded graph; a chain draws its tokens
    from the draft (the ratio test) unless it proposes the draft's most likely ones ("proposed":
    ``sample_drafts`` off); a stopping chain's length depends on the draft's confidence only,
    so it keeps the law too; top-k and top-p filter the drafted, accepted and resampled tokens
    alike."""
    target = tiny_target(4, sharp=3.0) if fmt == "fp32" else _quantised_target(4, fmt, fused, sharp=3.0)
    drafter = perturbed_drafter(target, noise=0.3)
    stopping = TreeConfig(top_k=1, depth=3, total_tokens=3, min_prob=0.08)  # this target is less peaked
    proposed = replace(CHAIN, sample_drafts=False)
    tree = {True: CHAIN, "stopping": stopping, "proposed": proposed}.get(
        chain, TreeConfig(top_k=3, depth=3, total_tokens=8)
    )
    prompt = prompt_of(8, 5)
    exact = exact_second_token(target, prompt, temperature=1.0, **filters).float()
    n = 1500
    counts = torch.zeros(exact.numel())
    accepted, sizes = 0, set()
    for s in range(n):
        params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=s, **filters)
        evs = spec_events(target, drafter, prompt, params, tree)
        counts[[t for ev in evs for t in ev.tokens][1]] += 1
        accepted += sum(ev.accepted for ev in evs)
        sizes |= {ev.tree_size for ev in evs if not ev.prefill}
    # drafts really were accepted, so acceptance is what is tested (a stopping chain drafts less)
    assert accepted > (n // 5 if chain == "stopping" else n // 4)
    if chain == "stopping":
        assert len(sizes) > 1, sizes  # the chain's length really varied
    assert chi2_pvalue(counts, exact) > 1e-3
    # The same check rejects a distribution that is somewhat off (sharpened: p^1.35).
    sharpened = exact**1.35 / (exact**1.35).sum()
    assert (
        chi2_pvalue(
            torch.multinomial(sharpened, n, replacement=True, generator=torch.Generator().manual_seed(0))
            .bincount(minlength=exact.numel())
            .float(),
            exact,
        )
        < 1e-3
    )


def test_make_decoder_refuses_bad_configurations(target):
    from evospec.decoding.methods import make_decoder
    from evospec.models.eagle import new_eagle_for

    with pytest.raises(ValueError, match="needs a draft head"):
        make_decoder("eagle2", target)
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        make_decoder("eagle2", target, draft=new_eagle_for(target), tree=TreeConfig(top_k=65))
    with pytest.raises(ValueError, match="unknown method"):
        make_decoder("medusa", target)


def test_a_stopping_chain_drafts_only_while_the_draft_is_confident(target, drafters):
    """min_prob sizes each round's chain: a doubtful draft verifies the root alone (a plain
    step), a confident one up to depth tokens; greedy output is AR's either way. A perfect draft
    of a very peaked target is sure of every token: full chains, all accepted."""
    prompt = prompt_of(3, 9)
    params = SamplingParams(max_new_tokens=40)
    for name in ("eagle-random", "perturbed", "perfect"):
        evs = spec_events(target, drafters[name], prompt, params, STOPPING)
        assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)
        sizes = [ev.tree_size for ev in evs if not ev.prefill]
        assert max(sizes) <= STOPPING.depth
        if name == "eagle-random":
            assert min(sizes) == 0 and max(sizes) == STOPPING.depth  # both kinds of round happen
    sure = tiny_target(5, sharp=40.0)
    evs = [ev for ev in spec_events(sure, TargetDrafter(sure), prompt, params, STOPPING) if not ev.prefill]
    assert all(ev.tree_size == ev.accepted == STOPPING.depth for ev in evs[:-1])


def test_a_stopping_chain_needs_a_chain_and_a_probability():
    with pytest.raises(ValueError, match="top_k 1"):
        TreeConfig(top_k=2, depth=3, total_tokens=4, min_prob=0.2)
    for bad in (1.0, -0.1, True, "0.2"):
        with pytest.raises(ValueError, match="min_prob"):
            TreeConfig(top_k=1, depth=3, total_tokens=3, min_prob=bad)


class _SpyDrafter:
    """Records each catch-up and commit (kind, pairs) and how many events the caller held then."""

    def __init__(self, inner, seen: list) -> None:
        self.inner, self.seen, self.calls = inner, seen, []

    def catch_up(self, features, tokens):
        self.calls.append(("catch_up", tokens.numel(), len(self.seen)))
        self.inner.catch_up(features, tokens)

    def commit(self, features, tokens, k, choose=None):
        self.calls.append(("commit", tokens.numel(), len(self.seen)))
        return self.inner.commit(features, tokens, k, choose)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_draft_catches_up_on_the_prompt_in_the_prefill(target):
    """The draft's prefill belongs to the request's prefill: the prompt's pairs are committed
    before the first token is handed out, and every drafted round then commits only the pairs
    the round before verified (at most a chain's accepted tokens and its bonus)."""
    from evospec.decoding.speculative import generate_speculative

    prompt, seen, params = prompt_of(4, 9), [], SamplingParams(max_new_tokens=20)
    spy = _SpyDrafter(eagle_drafter(target), seen)
    for ev in generate_speculative(target, spy, prompt, params, CHAIN):
        seen.append(ev)
    assert spy.calls[0] == ("catch_up", len(prompt), 0)  # before the prefill event
    commits = [call for call in spy.calls if call[0] == "commit"]
    assert commits[0][1] == 0  # the first round: nothing verified since the prefill
    assert all(0 < m <= CHAIN.depth + 1 for _, m, _ in commits[1:])
    assert len(commits) == len(seen) - 1  # lookup off: every round drafted
    assert [t for ev in seen for t in ev.tokens] == ar_tokens(target, prompt, params)

    spy.calls.clear()
    one = list(generate_speculative(target, spy, prompt, SamplingParams(max_new_tokens=1), CHAIN))
    assert len(one) == 1 and spy.calls == []  # the first token ends it: no draft prefill


@torch.inference_mode()
def test_commit_after_a_catch_up_equals_one_commit_of_every_pair(target):
    """``catch_up`` then an empty ``commit`` proposes what one commit of the same pairs does."""
    feats = torch.randn(7, target.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    toks = torch.tensor(prompt_of(5, 7))
    one, two = eagle_drafter(target, seed=2), eagle_drafter(target, seed=2)
    for d in (one, two):
        d.start(prompt_of(5, 8), 64)
    logp1, ids1 = one.commit(feats, toks, 4)
    two.catch_up(feats[:5], toks[:5])
    two.catch_up(feats[5:], toks[5:])
    logp2, ids2 = two.commit(feats[:0], toks[:0], 4)
    assert torch.equal(ids1, ids2)
    torch.testing.assert_close(logp1, logp2)
    assert one.cache.length == two.cache.length == 7

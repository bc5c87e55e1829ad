"""Speculative decoding with EAGLE-3 heads: output equals AR (greedy, many prompts, seeds and
trees; full and d2t vocabularies; fp32 and int4 targets), and sampling follows the target."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle3 import new_eagle3_for
from evospec.train.trainer import train_head
from tests.decoding.spec_helpers import ar_tokens, prompt_of, tiny_target
from tests.vocab.helpers import SMALL, stand_in_indices

TREES = [TreeConfig(top_k=4, depth=4, total_tokens=12), TreeConfig(top_k=1, depth=3, total_tokens=3)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target and an EAGLE-3 head trained on its answers (so drafts get accepted)."""
    from evospec.train.trainer import load_sequences
    from tests.train.test_eagle3_training import tiny_config, tiny_data, trainable_head

    work = tmp_path_factory.mktemp("e3")
    target = tiny_target(0, sharp=4.0)
    shards, aux, layers = tiny_data(work, target)
    seqs = load_sequences(shards, 100, aux)
    head = trainable_head(target, layers)
    cfg = tiny_config(holdout=0.1, steps=2)
    train_head(head, target, seqs, work / "ckpt", cfg, progress=False)
    for p in head.parameters():
        p.requires_grad_(False)
    return target, head.eval()


def _d2t_copy(target, head, size: int, shuffle: bool = False):
    """The same head restricted to a draft vocabulary of ``size`` ids (its d2t / t2d): the first
    ones, or (``shuffle``) a random choice in a random order, so a draft row is not its id."""
    ids = torch.arange(target.cfg.vocab_size)[:size]
    if shuffle:
        ids = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:size]
    small = new_eagle3_for(target, aux_layers=head.aux_layers, draft_ids=ids)
    state = {k: v for k, v in head.state_dict().items() if k != "lm_head.weight"}
    small.load_state_dict(state, strict=False)
    with torch.no_grad():
        small.lm_head.weight.copy_(head.lm_head.weight[ids])
    return small


def _run(dec, prompt, params):
    return [t for ev in dec.generate(prompt, params) for t in ev.tokens], dec


@pytest.mark.parametrize("tree", TREES, ids=["k4d4t12", "chain3"])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("vocab", ["full", "d2t"])
def test_greedy_equals_ar(trained, tree, seed, vocab):
    target, head = trained
    draft = head if vocab == "full" else _d2t_copy(target, head, 40)
    dec = make_decoder("eagle3", target, draft=draft, tree=tree)
    prompt = prompt_of(seed, 3 + 2 * seed)
    params = SamplingParams(max_new_tokens=24)
    got, _ = _run(dec, prompt, params)
    assert got == ar_tokens(target, prompt, params)
    assert dec.vocab.name == ("full" if vocab == "full" else "d2t")


def test_drafts_are_accepted_and_coverage_is_counted(trained):
    target, head = trained
    dec = make_decoder("eagle3", target, draft=_d2t_copy(target, head, 40), tree=TREES[0])
    evs = [ev for ev in dec.generate(prompt_of(1, 6), SamplingParams(max_new_tokens=40)) if not ev.prefill]
    assert sum(ev.accepted for ev in evs) > 0  # the trained head really drafts the target's tokens
    covered = sum(ev.vocab.covered for ev in evs)
    verified = sum(ev.vocab.verified for ev in evs)
    assert 0 < covered <= verified


@pytest.mark.parametrize("policy", ["frspec-e3", "nanospec-e3", "evospec-e3", "nanospec+evospec-e3"])
def test_vocabulary_policies_on_a_full_vocabulary_head(trained, policy):
    target, head = trained
    dec = make_decoder(
        policy, target, draft=head, tree=TREES[0], vocab=SMALL, indices=stand_in_indices(target)
    )
    try:
        for seed in range(3):
            prompt = prompt_of(10 + seed, 5)
            params = SamplingParams(max_new_tokens=20)
            assert _run(dec, prompt, params)[0] == ar_tokens(target, prompt, params)
    finally:
        dec.close()


def test_policies_refuse_a_d2t_head_and_methods_their_head_type(trained):
    from evospec.models.eagle import new_eagle_for

    target, head = trained
    with pytest.raises(ValueError, match="full-vocabulary EAGLE-3 head"):
        make_decoder("frspec-e3", target, draft=_d2t_copy(target, head, 40), indices=stand_in_indices(target))
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        make_decoder("eagle3", target, draft=new_eagle_for(target))
    with pytest.raises(ValueError, match="EAGLE-2 head"):
        make_decoder("eagle2", target, draft=head)


def test_int4_target_greedy_equals_ar(trained):
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import kernels_available, quantize_linears
    from evospec.models.step import StepGraph

    if not kernels_available("int4"):
        pytest.skip("torch without CPU int4 kernels")
    _, head = trained
    q = tiny_target(0, sharp=4.0)
    quantize_linears(q, "int4")
    q.exact_rows = True
    enable_fused_ops(q)
    q.step_graph = StepGraph(q)
    draft = head.clone().attach(q)
    for tree in TREES:
        dec = make_decoder("eagle3", q, draft=draft, tree=tree)
        for seed in range(3):
            prompt = prompt_of(20 + seed, 6)
            params = SamplingParams(max_new_tokens=24)
            assert _run(dec, prompt, params)[0] == ar_tokens(q, prompt, params)


@pytest.mark.parametrize("shape", ["tree", "drawn-chain-d2t"])
def test_sampled_tokens_follow_the_target(trained, shape):
    """The second generated token (drafted, accepted or resampled) has the target's marginal; a
    chain over a d2t head's draft vocabulary draws from it, mapped back to target ids."""
    from tests.decoding.spec_helpers import chi2_pvalue, exact_second_token, sampled_second_tokens

    target, head = trained
    if shape == "tree":
        dec = make_decoder("eagle3", target, draft=head, tree=TreeConfig(top_k=3, depth=3, total_tokens=8))
    else:  # three quarters of the ids, shuffled: each draw's row maps to another target id
        small = _d2t_copy(target, head, target.cfg.vocab_size * 3 // 4, shuffle=True)
        dec = make_decoder("eagle3", target, draft=small, tree=TreeConfig(top_k=1, depth=3, total_tokens=3))
    prompt = prompt_of(3, 7)  # a training prompt: the tiny head knows its continuation
    exact = exact_second_token(target, prompt, temperature=0.5).float()
    counts, accepted = sampled_second_tokens(dec, prompt, 0.5, n=600)
    assert accepted > 0  # some drafts are accepted (the tiny head rarely matches a sampled token;
    # the shared verifier's law under heavy acceptance is tested in test_speculative.py)
    assert chi2_pvalue(counts, exact) > 1e-3


@pytest.mark.parametrize("method", ["eagle3", "frspec-e3"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_context_lookup_equals_ar(trained, method, seed):
    """Lookup rounds defer an EAGLE-3 drafter's catch-up too: the pairs it commits later carry
    the three target layers' features of every round verified since."""
    target, head = trained
    tree = TreeConfig(top_k=1, depth=2, total_tokens=2, lookup=3, lookup_ngram=1)
    dec = make_decoder(method, target, draft=head, tree=tree, vocab=SMALL, indices=stand_in_indices(target))
    phrase = prompt_of(seed, 5)
    prompt = [*prompt_of(seed + 40, 3), *phrase, *prompt_of(seed + 80, 2), *phrase[:3]]
    params = SamplingParams(max_new_tokens=32)
    evs = list(dec.generate(prompt, params))
    assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)
    kinds = {ev.looked_up for ev in evs[1:]}
    assert kinds == {True, False}  # both kinds of round ran
    dec.close()


class _CheckingTargetDrafter:
    """The target drafting for itself (a perfect draft) that also checks every committed pair's
    features: the three draft layers' outputs of the target at that pair's position, concatenated."""

    def __init__(self, target, layers) -> None:
        from evospec.decoding.drafter import TargetDrafter

        self.inner, self.target, self.layers = TargetDrafter(target), target, layers
        self.checked = 0

    def start(self, prompt, max_len):
        self.seq = list(prompt[:1])  # x_0, then the token of every committed pair
        self.inner.start(prompt, max_len)

    def commit(self, features, tokens, k, choose=None):
        if tokens.numel():
            self._check(features, tokens)
        return self.inner.commit(features, tokens, k, choose)

    def catch_up(self, features, tokens):
        self._check(features, tokens)
        self.inner.catch_up(features, tokens)

    def _check(self, features, tokens):
        m = tokens.numel()
        self.seq += tokens.tolist()
        n = len(self.seq) - 1  # pairs committed so far: features of positions 0..n-1
        ids = torch.tensor([self.seq[:n]])
        out = self.target(
            ids, torch.arange(n), self.target.new_cache(n), logits="none", aux_layers=self.layers
        )
        want = torch.cat(out.aux_hidden, dim=-1)[0, n - m : n]  # [m, 3 D]
        assert features.shape == want.shape
        torch.testing.assert_close(features, want, atol=1e-4, rtol=1e-4)
        self.checked += m

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("lookup", [0, 3], ids=["drafted", "with-lookup"])
def test_a_perfect_draft_accepts_everything_and_reads_the_three_layers(trained, lookup):
    """A drafter that is the target itself proposes exactly the greedy tokens, so every drafted
    token is accepted -- and every (feature, token) pair it is handed, in drafted rounds and
    after deferred lookup rounds, carries the three layers' outputs at its own position."""
    from evospec.decoding.speculative import generate_speculative

    target, head = trained
    tree = TreeConfig(top_k=1, depth=3, total_tokens=3, lookup=lookup, lookup_ngram=1)
    params = SamplingParams(max_new_tokens=30)
    drafted = 0
    for seed in range(3):
        phrase = prompt_of(seed, 5)
        prompt = [*prompt_of(seed + 40, 3), *phrase, *prompt_of(seed + 80, 2), *phrase[:3]]
        drafter = _CheckingTargetDrafter(target, head.aux_layers)
        evs = list(generate_speculative(target, drafter, prompt, params, tree, draft_layers=head.aux_layers))
        assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)
        for ev in evs[1:]:
            if not ev.looked_up and ev.finish_reason is None:
                drafted += 1
                assert ev.accepted == ev.tree_size == 3
        assert drafter.checked >= len(prompt) - 1
    assert drafted > 0

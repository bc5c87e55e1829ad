"""Context lookup: the n-gram index, and rounds that verify its tokens stay lossless."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.lookup import ContextLookup
from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import (
    ar_tokens,
    chi2_pvalue,
    eagle_drafter,
    exact_second_token,
    perturbed_drafter,
    prompt_of,
    sampled_second_tokens,
    spec_events,
    tiny_target,
)
from tests.decoding.test_speculative import _quantised_target


def test_the_latest_earlier_occurrence_of_the_longest_match_proposes():
    lk = ContextLookup(min_n=1, max_n=3)
    lk.reset([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # the last 3-gram (1 2 3) occurred at the start: its continuation 4 9 2, capped at 3 tokens
    assert lk.propose(5) == [4, 9, 2]
    lk.extend([8])  # ... 3 8: no 3- or 2-gram occurred before; the 1-gram 8 neither
    assert lk.propose(5) == []
    lk.extend([2, 3])  # ... 8 2 3: "2 3" occurred twice; the latest one (followed by 8) wins
    assert lk.propose(5) == [8, 2]  # a 2-token match proposes at most 2 tokens
    assert lk.propose(1) == [8]


def test_matches_shorter_than_min_n_are_ignored_and_reset_forgets():
    lk = ContextLookup(min_n=2, max_n=4)
    lk.reset([5, 6, 7, 6])
    assert lk.propose(3) == []  # only the 1-gram 6 repeats
    lk.extend([7])
    assert lk.propose(3) == [6, 7]  # "6 7" occurred: the tokens after it, up to the end
    lk.reset([1, 2])
    assert lk.tokens == [1, 2] and lk.propose(3) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        ContextLookup(min_n=3, max_n=2)


def test_tree_settings_check_the_lookup_fields():
    assert TreeConfig(lookup=3).max_nodes == TreeConfig().max_nodes  # a 60-token tree is bigger
    assert TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=4).max_nodes == 5
    with pytest.raises(ValueError, match=r"tree\.lookup must be an integer >= 0"):
        TreeConfig(lookup=-1)
    with pytest.raises(ValueError, match=r"tree\.lookup_ngram must be <= 5"):
        TreeConfig(lookup_ngram=6)


CHAIN1 = TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, lookup_ngram=1)
TREE = TreeConfig(top_k=3, depth=2, total_tokens=5, lookup=2, lookup_ngram=2)


def _repetitive_prompt(seed: int) -> list[int]:
    """A prompt that repeats a phrase: lookup has something to find from the first round."""
    phrase = prompt_of(seed, 5)
    return [*prompt_of(seed + 50, 3), *phrase, *prompt_of(seed + 90, 2), *phrase[:3]]


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.mark.parametrize("tree", [CHAIN1, TREE], ids=["chain1+lookup3", "k3d2t5+lookup2"])
@pytest.mark.parametrize("drafter", ["eagle-random", "perturbed", "none"])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_with_lookup_equals_ar(target, drafter, tree, seed):
    """Lookup rounds, drafted rounds between them (their catch-up spanning several rounds),
    and the ngram method's plain steps all give plain decoding's tokens."""
    drafters = {
        "eagle-random": lambda: eagle_drafter(target, seed=seed),
        "perturbed": lambda: perturbed_drafter(target, noise=0.6, seed=seed),
        "none": lambda: None,
    }
    prompt = _repetitive_prompt(seed)
    params = SamplingParams(max_new_tokens=32)
    evs = spec_events(target, drafters[drafter](), prompt, params, tree)
    assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)
    rounds = [ev for ev in evs if not ev.prefill]
    assert any(ev.looked_up and ev.tree_size > 0 for ev in rounds)  # lookup really proposed
    assert drafter == "none" or any(not ev.looked_up for ev in rounds)  # and the draft drafted


def test_lookup_rounds_accept_what_the_context_repeats(target):
    """Across seeds, lookup rounds accept tokens (the greedy outputs of a random target repeat
    themselves), and every drafted-nothing round is a one-row step."""
    accepted = proposed = 0
    for seed in range(6):
        prompt = _repetitive_prompt(seed)
        for ev in spec_events(target, None, prompt, SamplingParams(max_new_tokens=48), CHAIN1):
            if ev.prefill:
                continue
            assert ev.looked_up
            proposed += ev.tree_size
            accepted += ev.accepted
    assert proposed > 0 and accepted > 0.2 * proposed


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("seed", range(3))
def test_greedy_with_lookup_equals_ar_on_a_quantised_target(fmt, seed):
    """Every lookup length verifies through its own recorded chain graph, bitwise as AR."""
    target = _quantised_target(6, fmt)
    prompt = _repetitive_prompt(seed)
    params = SamplingParams(max_new_tokens=32)
    want = ar_tokens(target, prompt, params)
    for drafter in (None, perturbed_drafter(target, noise=0.6, seed=seed)):
        evs = spec_events(target, drafter, prompt, params, CHAIN1)
        assert [t for ev in evs for t in ev.tokens] == want


def _oracle_lookup(target, monkeypatch, when=lambda last: True) -> None:
    """Make lookups propose the target's own greedy next tokens (as a lookup that found the
    right continuation would) where ``when(last token)``, so that sampling accepts many."""

    def propose(self, k):
        ids = list(self.tokens)
        if not when(ids[-1]):
            return []
        out = []
        for _ in range(min(k, 2)):
            cache = target.new_cache(len(ids))
            logits = target(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="last").logits
            out.append(int(logits[0, -1].argmax()))
            ids.append(out[-1])
        return out

    monkeypatch.setattr(ContextLookup, "propose", propose)


def test_the_ngram_method_needs_no_head_and_samples_the_target_law(monkeypatch):
    """``ngram`` builds without a draft head; at T=1 its second token follows the target's
    law, whether lookup found nothing, a wrong or a right continuation."""
    target = tiny_target(4, sharp=3.0)
    dec = make_decoder("ngram", target, tree=TreeConfig(top_k=1, depth=1, total_tokens=1, lookup_ngram=1))
    assert dec.drafter is None and dec.tree.lookup > 0
    prompt = prompt_of(8, 60)  # most first tokens occurred in it: the second is usually looked up
    exact = exact_second_token(target, prompt, temperature=1.0).float()
    counts, accepted = sampled_second_tokens(dec, prompt, 1.0, 1000)
    assert accepted > 0 and chi2_pvalue(counts, exact) > 1e-3
    _oracle_lookup(target, monkeypatch)
    counts, accepted = sampled_second_tokens(dec, prompt, 1.0, 1500)
    assert accepted > 300  # good proposals, accepted or resampled as the target law says
    assert chi2_pvalue(counts, exact) > 1e-3


def test_sampled_tokens_follow_the_target_with_lookup_and_a_draft(monkeypatch):
    """Rounds alternate between the draft's tree and (oracle) lookups; the law holds."""
    target = tiny_target(4, sharp=3.0)
    _oracle_lookup(target, monkeypatch, when=lambda last: last % 2 == 0)
    drafter = perturbed_drafter(target, noise=0.3)
    prompt = prompt_of(8, 60)
    exact = exact_second_token(target, prompt, temperature=1.0).float()
    counts = torch.zeros(exact.numel())
    looked = 0
    for s in range(1200):
        params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=s)
        evs = spec_events(target, drafter, prompt, params, CHAIN1)
        counts[[t for ev in evs for t in ev.tokens][1]] += 1
        looked += sum(ev.looked_up for ev in evs)
    assert 100 < looked < 1200  # both kinds of round happened
    assert chi2_pvalue(counts, exact) > 1e-3


def test_a_perfect_draft_still_accepts_everything_after_lookup_rounds(target):
    """Lookup rounds defer the drafter's catch-up; the next drafted round commits every pair
    verified since. A target drafting for itself then proposes exactly its own greedy tokens,
    which it can only do if no pair was lost or misplaced."""
    from evospec.decoding.drafter import TargetDrafter

    tree = TreeConfig(top_k=1, depth=2, total_tokens=2, lookup=3, lookup_ngram=1)
    drafted = looked = 0
    for seed in range(4):
        evs = spec_events(
            target, TargetDrafter(target), _repetitive_prompt(seed), SamplingParams(max_new_tokens=40), tree
        )
        for ev in evs[1:]:
            if ev.looked_up:
                looked += 1
            else:
                drafted += 1
                assert ev.accepted == ev.tree_size == 2
    assert drafted > 0 and looked > 0

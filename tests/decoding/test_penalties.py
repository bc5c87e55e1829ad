"""Presence / frequency penalties and logit_bias: the one adjustment every loop picks from, so
penalised output is the same whichever method or batch generates it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.drafter import TargetDrafter
from evospec.decoding.penalties import Generated, Penalties, adjusted
from evospec.decoding.sampling import SamplingParams, greedy_ids, target_probs
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import (
    ar_tokens,
    chi2_pvalue,
    perturbed_drafter,
    prompt_of,
    spec_events,
    tiny_target,
)

TREE = TreeConfig(top_k=3, depth=3, total_tokens=8)
CHAIN = TreeConfig(top_k=1, depth=3, total_tokens=3)
REPEAT = Penalties(presence=0.5, frequency=1.5)


def test_repetition_scales_every_seen_logit_toward_zero_side():
    row = torch.tensor([2.0, -2.0, 4.0, -4.0, 1.0])
    out = adjusted(row, Penalties(repetition=2.0), Generated([2, 3], prompt=[0, 1]))
    assert out.tolist() == [1.0, -4.0, 2.0, -8.0, 1.0]  # id 4 was never seen
    both = adjusted(row, Penalties(repetition=2.0, presence=1.0), Generated([2], prompt=[0]))
    assert both.tolist() == [1.0, -2.0, 1.0, -4.0, 1.0]  # repetition first, then the presence penalty


def test_adjusted_subtracts_penalties_by_count_and_adds_the_bias():
    row = torch.zeros(6)
    out = adjusted(
        row, Penalties(presence=0.5, frequency=1.0, bias=((4, 3.0), (2, -1.0))), Generated([1, 1, 2])
    )
    assert out.tolist() == [0.0, -2.5, -2.5, 0.0, 3.0, 0.0]
    assert row.tolist() == [0.0] * 6  # a new row
    assert adjusted(row, Penalties(), Generated([1])) is row  # nothing to move
    assert adjusted(row, Penalties(bias=((0, 1.0),)), None).tolist() == [1.0, 0, 0, 0, 0, 0]
    g = Generated([3])
    assert g.plus([3, 5]).counts == {3: 2, 5: 1} and g.counts == {3: 1}


@pytest.mark.parametrize(
    "kw",
    [
        {"presence": 2.5},
        {"frequency": -2.1},
        {"bias": ((1, 1.0), (1, 2.0))},
        {"bias": ((-1, 1.0),)},
        {"bias": ((0, 101.0),)},
        {"repetition": 0.001},
        {"repetition": 2.5},
    ],
)
def test_penalties_refuse_what_openai_refuses(kw):
    with pytest.raises(ValueError):
        Penalties(**kw)


@pytest.fixture(scope="module")
def target():
    return tiny_target(2)


def _looping_prompt(target) -> list[int]:
    """A prompt whose greedy continuation repeats ids (where penalties bite)."""
    for seed in range(40):
        prompt = prompt_of(seed, 6)
        out = ar_tokens(target, prompt, SamplingParams(max_new_tokens=24))
        if len(set(out)) < 16:
            return prompt
    raise AssertionError("no looping prompt")


def test_plain_decoding_picks_the_best_adjusted_logit_at_each_step(target):
    prompt = _looping_prompt(target)
    params = SamplingParams(max_new_tokens=24, penalties=REPEAT)
    tokens = ar_tokens(target, prompt, params)
    assert tokens != ar_tokens(target, prompt, SamplingParams(max_new_tokens=24))  # the penalty bites
    ids = [*prompt, *tokens]
    logits = target(
        torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(len(ids)), logits="all"
    ).logits[0]
    for i, tok in enumerate(tokens):
        row = adjusted(logits[len(prompt) - 1 + i], REPEAT, Generated(tokens[:i]))
        assert int(greedy_ids(row)) == tok
    repeat = Penalties(repetition=1.8)
    tokens = ar_tokens(target, prompt, SamplingParams(max_new_tokens=24, penalties=repeat))
    assert tokens != ar_tokens(target, prompt, SamplingParams(max_new_tokens=24))
    ids = [*prompt, *tokens]
    logits = target(
        torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(len(ids)), logits="all"
    ).logits[0]
    for i, tok in enumerate(tokens):  # the prompt's ids count too
        row = adjusted(logits[len(prompt) - 1 + i], repeat, Generated(tokens[:i], prompt))
        assert int(greedy_ids(row)) == tok
    forced = SamplingParams(max_new_tokens=5, penalties=Penalties(bias=((7, 100.0),)))
    assert ar_tokens(target, prompt, forced) == [7] * 5


@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("prefetch", [None, 0.5], ids=["all-rows", "lazy-rows"])
@pytest.mark.parametrize("drafter", ["perfect", "perturbed", "lookup"])
def test_speculative_greedy_with_penalties_equals_plain_decoding(target, tree, prefetch, drafter):
    """The draft proposes the unpenalised tokens; verification picks each node's adjusted best."""
    prompt = _looping_prompt(target)
    params = SamplingParams(max_new_tokens=30, penalties=replace(REPEAT, bias=((3, 1.5),), repetition=1.3))
    cfg = replace(tree, lookup=2) if drafter == "lookup" else tree
    drafters = {"perfect": TargetDrafter(target), "perturbed": perturbed_drafter(target, 0.6), "lookup": None}
    events = spec_events(target, drafters[drafter], [*prompt, *prompt], params, cfg, prefetch=prefetch)
    assert [t for ev in events for t in ev.tokens] == ar_tokens(target, [*prompt, *prompt], params)
    if drafter == "perfect":
        assert any(ev.accepted for ev in events)


def test_sampled_tokens_follow_the_penalised_distribution(target):
    """The second token's law with penalties (the first token counted) and a bias, from the
    target directly, against drafted chains verified by the ratio test on adjusted rows; and
    its repeats of the first token as rare as the law says (a loop that forgot the history
    would repeat it as often as the unpenalised law does)."""
    penalties = Penalties(presence=2.0, frequency=2.0, bias=((5, 4.0),))  # 5 first, likely
    sharp = tiny_target(4, sharp=3.0)
    prompt = prompt_of(8, 5)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=12, penalties=penalties)

    def probs(ids: list[int], generated: list[int]) -> torch.Tensor:
        logits = sharp(
            torch.tensor([ids]), torch.arange(len(ids)), sharp.new_cache(len(ids)), logits="last"
        ).logits
        return target_probs(adjusted(logits[0, -1], penalties, Generated(generated)), params).double()

    p1 = probs(prompt, [])
    firsts = [x for x in range(p1.numel()) if p1[x] > 1e-7]
    exact = sum(p1[x] * probs([*prompt, x], [x]) for x in firsts).float()
    repeat = float(sum(p1[x] * probs([*prompt, x], [x])[x] for x in firsts))
    forgetful = float(sum(p1[x] * probs([*prompt, x], [])[x] for x in firsts))
    n, counts, accepted, repeats = 1200, torch.zeros(exact.numel()), 0, 0
    drafter = perturbed_drafter(sharp, noise=0.3)
    for s in range(n):
        evs = spec_events(sharp, drafter, prompt, replace(params, seed=s), CHAIN)
        x1, x2 = [t for ev in evs for t in ev.tokens]
        counts[x2] += 1
        repeats += x1 == x2
        accepted += sum(ev.accepted for ev in evs)
    assert accepted > n // 5
    assert chi2_pvalue(counts, exact) > 1e-3
    assert forgetful > 0.05 and repeats < n * (repeat + forgetful) / 2, (repeat, forgetful, repeats / n)


def test_events_report_raw_logprobs_under_penalties(target):
    prompt = _looping_prompt(target)
    params = SamplingParams(max_new_tokens=24, penalties=REPEAT, logprobs=1)
    events = list(generate_ar(target, prompt, params))
    assert any(lp.top[0][0] != lp.token for ev in events for lp in ev.logprobs)  # picked: not the raw best

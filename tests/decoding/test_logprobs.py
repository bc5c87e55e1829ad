"""Token log-probabilities: the target's raw distribution at each generated token, the same
whichever loop (plain, speculative, batched) produced it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.drafter import TargetDrafter
from evospec.decoding.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, for_tokens, row_logprobs
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import perturbed_drafter, prompt_of, spec_events, tiny_target

TREE = TreeConfig(top_k=3, depth=3, total_tokens=8)
CHAIN = TreeConfig(top_k=1, depth=3, total_tokens=3)


def test_row_logprobs_are_log_softmax_with_the_best_alternatives_first():
    rows = torch.tensor([[1.0, 3.0, 2.0, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = row_logprobs(rows, [2, 4], top=3)
    ref = torch.log_softmax(rows.double(), -1)
    assert out[0].token == 2 and out[0].logprob == pytest.approx(float(ref[0, 2]), abs=1e-6)
    assert [i for i, _ in out[0].top] == [1, 3, 2]  # equal values: the lower id first
    assert [lp for _, lp in out[0].top] == pytest.approx(ref[0, [1, 3, 2]].tolist(), abs=1e-6)
    assert [i for i, _ in out[1].top] == [0, 1, 2]  # all equal: ids ascending
    assert out[1].logprob == pytest.approx(-math.log(5), abs=1e-6)
    assert row_logprobs(rows[:1], [0], top=0)[0].top == ()


def test_row_logprobs_keep_float_precision_far_in_the_tail():
    row = torch.tensor([[0.0, -200.0, 50.0]])
    lp = row_logprobs(row, [1], top=1)[0]
    assert lp.logprob == pytest.approx(-250.0, abs=1e-4)  # no underflow to -inf
    assert lp.top == ((2, pytest.approx(0.0, abs=1e-6)),)


def test_row_logprobs_report_nan_rows_and_refuse_bad_shapes():
    nan = row_logprobs(torch.tensor([[0.0, float("nan")]]), [0], top=2)[0]
    assert math.isnan(nan.logprob) and len(nan.top) == 2
    with pytest.raises(ValueError, match="rows of logits"):
        row_logprobs(torch.zeros(2, 4), [1], top=0)
    with pytest.raises(ValueError, match="top must be"):
        row_logprobs(torch.zeros(1, 4), [1], top=MAX_TOP_LOGPROBS + 1)
    assert for_tokens(None, torch.zeros(1, 4), [1]) is None
    assert len(for_tokens(0, torch.zeros(3, 4), [1, 2])) == 2  # an event clipped at a stop


def test_sampling_params_bound_the_alternatives():
    assert SamplingParams(logprobs=MAX_TOP_LOGPROBS).logprobs == MAX_TOP_LOGPROBS
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


def _teacher_forced(target, prompt: list[int], tokens: list[int], top: int) -> list[TokenLogprob]:
    """The logprobs of ``tokens`` read off one forward over prompt + tokens."""
    ids = [*prompt, *tokens]
    cache = target.new_cache(len(ids))
    logits = target(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="all").logits[0]
    return row_logprobs(logits[len(prompt) - 1 : len(ids) - 1], tokens, top)


def _flat(events) -> tuple[list[int], list[TokenLogprob]]:
    tokens, lps = [], []
    for ev in events:
        assert ev.logprobs is not None and len(ev.logprobs) == len(ev.tokens)
        assert [lp.token for lp in ev.logprobs] == ev.tokens
        tokens += ev.tokens
        lps += ev.logprobs
    return tokens, lps


def _close(a: list[TokenLogprob], b: list[TokenLogprob], tol: float = 1e-4) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.token == y.token and x.logprob == pytest.approx(y.logprob, abs=tol)
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=tol)


@pytest.fixture(scope="module")
def target():
    return tiny_target(3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_decoding_reports_the_logprobs_of_what_it_generated(target, temperature):
    prompt = prompt_of(1, 7)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5, logprobs=4)
    tokens, lps = _flat(generate_ar(target, prompt, params))
    assert len(tokens) == 12
    _close(lps, _teacher_forced(target, prompt, tokens, 4))
    if temperature == 0.0:  # greedy: each token is its row's best
        assert all(lp.top[0][0] == lp.token for lp in lps)
    quiet = list(generate_ar(target, prompt, replace(params, logprobs=None)))
    assert all(ev.logprobs is None for ev in quiet)
    assert [t for ev in quiet for t in ev.tokens] == tokens  # asking does not change the output


@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("prefetch", [None, 0.5], ids=["all-rows", "lazy-rows"])
@pytest.mark.parametrize("drafter", ["perfect", "perturbed", "lookup"])
def test_speculative_rounds_report_what_plain_decoding_reports(target, tree, prefetch, drafter):
    """Accepted draft tokens and bonus tokens alike: their rows are the verified nodes'."""
    prompt = [*prompt_of(2, 6), *prompt_of(2, 6)]  # a repeat, for context lookup to find
    params = SamplingParams(max_new_tokens=20, logprobs=3)
    cfg = replace(tree, lookup=3) if drafter == "lookup" else tree
    drafters = {"perfect": TargetDrafter(target), "perturbed": perturbed_drafter(target, 0.6), "lookup": None}
    dr = drafters[drafter]
    events = spec_events(target, dr, prompt, params, cfg, prefetch=prefetch)
    assert any(ev.accepted for ev in events)  # rounds with drafted tokens were reported too
    tokens, lps = _flat(events)
    ar_tokens, ar_lps = _flat(generate_ar(target, prompt, params))
    assert tokens == ar_tokens
    _close(lps, ar_lps)


def test_sampled_speculative_tokens_report_the_target_distribution(target):
    prompt = prompt_of(4, 9)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_k=5, seed=11, logprobs=2)
    events = spec_events(target, perturbed_drafter(target, 0.3), prompt, params, CHAIN)
    tokens, lps = _flat(events)
    _close(lps, _teacher_forced(target, prompt, tokens, 2))  # raw logits: before temperature / top-k


def test_logprobs_stop_where_the_tokens_stop(target):
    prompt = prompt_of(5, 8)
    free = [t for ev in generate_ar(target, prompt, SamplingParams(max_new_tokens=20)) for t in ev.tokens]
    stop = free[6]
    params = SamplingParams(max_new_tokens=20, logprobs=0, stop_ids=frozenset({stop}))
    events = spec_events(target, TargetDrafter(target), prompt, params, TREE)
    tokens, lps = _flat(events)
    assert tokens == free[: free.index(stop) + 1] and len(lps) == len(tokens)
    assert all(lp.top == () for lp in lps)


@pytest.mark.parametrize("chunk", [3, 128])
def test_prompt_logprobs_score_every_token_after_the_first(target, chunk):
    from evospec.decoding.logprobs import prompt_logprobs

    prompt = prompt_of(6, 11)
    got = prompt_logprobs(target, prompt, 2, chunk=chunk)
    assert [lp.token for lp in got] == prompt[1:]
    _close(got, _teacher_forced(target, prompt[:1], prompt[1:], 2))
    assert prompt_logprobs(target, prompt[:1], 2) == []

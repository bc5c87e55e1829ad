"""Replayed decoding matches live decoding round for round (greedy), for every policy."""

from __future__ import annotations

import pytest

from evospec.adapt.config import AdaptConfig
from evospec.bench.replay import record_requests, replay_request
from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from tests.decoding.spec_helpers import prompt_of, tiny_target
from tests.vocab.helpers import SMALL, stand_in_indices

V = 64
EOS = (V - 1,)
TREE = TreeConfig(top_k=12, depth=4, total_tokens=40)  # wide: a random head still hits
ADAPT = AdaptConfig(buffer_size=4, lr=1e-2, context=8, k_logit=16, rank=4, alpha=4, asynchronous=False)
MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target(5, sharp=3.0)


@pytest.fixture(scope="module")
def recorded(target):
    prompts = [prompt_of(i, 10 + i) for i in range(4)]
    return prompts, record_requests(target, prompts, MAX_NEW, EOS, support_k=32, batch_size=3)


def _decoder(target, method):
    return make_decoder(
        method,
        target,
        draft=new_eagle_for(target, seed=2),
        tree=TREE,
        vocab=SMALL,
        indices=stand_in_indices(target),
        eos_ids=EOS,
        adapt=ADAPT,
        verify_logits="all",
    )


def test_recording_is_the_greedy_answer_with_its_features(target, recorded):
    prompts, recs = recorded
    ar = make_decoder("ar", target, eos_ids=EOS)
    for prompt, rec in zip(prompts, recs, strict=True):
        answer = [t for ev in ar.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW)) for t in ev.tokens]
        assert rec.ids.tolist() == [*prompt, *answer]
        assert rec.features.shape == (len(prompt) + len(answer) - 1, target.cfg.hidden_size)
        assert rec.support_ids.shape == (len(answer) - 1, 32)
        # the greedy next token heads every support row
        assert rec.support_ids[:, 0].tolist() == answer[1:]


@pytest.mark.parametrize("method", ["eagle2", "frspec", "evospec", "clora"])
def test_replay_accepts_what_a_live_run_accepts(target, recorded, method):
    prompts, recs = recorded
    live, replayed = _decoder(target, method), _decoder(target, method)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    accepted = 0
    for prompt, rec in zip(prompts, recs, strict=True):
        events = list(live.generate(prompt, params))
        rounds = [ev for ev in events if not ev.prefill]
        got = replay_request(replayed, rec)
        assert got.rounds == len(rounds)
        assert got.accepted == sum(ev.accepted for ev in rounds)
        assert got.tokens == sum(len(ev.tokens) for ev in events)
        folded = RequestStats()  # the live run's events through the same fold
        for ev in events:
            folded.add(ev)
        assert (got.depth_counts, got.mal) == (folded.depth_counts, folded.mal)
        accepted += got.accepted
    assert accepted > 0  # the comparison saw accepted drafts, not only bonus tokens
    if method == "clora":
        assert replayed.adapt.stats.updates == live.adapt.stats.updates > 0

"""RequestStats: the one fold over step events (MAL, acceptance by depth, merge), on hand-made events."""

from __future__ import annotations

import pytest

from evospec.decoding.events import StepEvent
from evospec.decoding.stats import RequestStats
from evospec.vocab.active import VocabRoundStats, VocabTotals


def _vocab(verified: int, covered: int, retrieval_s: list[float] | None = None) -> VocabRoundStats:
    return VocabRoundStats(
        active_size=10,
        verified=verified,
        covered=covered,
        oov=covered < verified,
        retrieval_s=retrieval_s or [],
    )


def _speculative_request() -> list[StepEvent]:
    """Prefill, then rounds accepting 3, 0, 1 and 3 draft tokens; the last is clipped to 2 tokens."""
    return [
        StepEvent(tokens=[7], verify_s=0.5, prefill=True),
        StepEvent([1, 2, 3, 4], accepted=3, draft_s=0.1, verify_s=0.2, round_s=0.4, vocab=_vocab(4, 4)),
        StepEvent([5], accepted=0, draft_s=0.1, verify_s=0.2, round_s=0.3, vocab=_vocab(1, 0, [0.01])),
        StepEvent([6, 7], accepted=1, draft_s=0.1, verify_s=0.2, round_s=0.3, vocab=_vocab(2, 2)),
        StepEvent([8, 9], accepted=3, draft_s=0.1, verify_s=0.2, round_s=0.3, finish_reason="length"),
    ]


def _fold(events: list[StepEvent], stats: RequestStats | None = None) -> RequestStats:
    stats = stats if stats is not None else RequestStats()
    for ev in events:
        stats.add(ev)
    return stats


def test_counts_and_times_leave_the_prefill_out_of_the_rounds() -> None:
    st = _fold(_speculative_request())
    assert (st.tokens, st.rounds, st.accepted) == (10, 4, 7)
    assert st.prefill_s == pytest.approx(0.5)
    assert st.verify_s == pytest.approx(0.5 + 4 * 0.2)  # the prefill's forward is a target forward too
    assert st.draft_s == pytest.approx(0.4) and st.round_s == pytest.approx(1.3)
    assert (st.vocab.rounds, st.vocab.verified, st.vocab.covered, st.vocab.oov_events) == (3, 7, 6, 1)


def test_mal_is_accepted_plus_one_per_round_before_clipping() -> None:
    st = _fold(_speculative_request())
    assert st.mal == pytest.approx((4 + 7) / 4)  # 2.75, not the clipped (10 - 1) / 4 = 2.25


def test_plain_decoding_scores_one_and_no_rounds_is_none() -> None:
    ar = _fold([StepEvent([1], verify_s=0.3, prefill=True), StepEvent([2]), StepEvent([3])])
    assert ar.mal == 1.0 and ar.rounds == 2 and ar.tokens == 3
    assert ar.acceptance_by_depth() == [] and ar.acceptance_by_depth(3) == [0.0, 0.0, 0.0]
    only_prefill = _fold([StepEvent([1], prefill=True, finish_reason="stop")])
    assert only_prefill.mal is None and only_prefill.rounds == 0 and only_prefill.tokens == 1
    assert only_prefill.acceptance_by_depth(3) == []


def test_acceptance_by_depth_is_the_share_of_rounds_accepting_at_least_d() -> None:
    st = _fold(_speculative_request())
    assert st.depth_counts == [3, 2, 2]  # rounds accepting >= 1, >= 2, >= 3 of (3, 0, 1, 3)
    assert st.acceptance_by_depth() == [0.75, 0.5, 0.5]
    assert st.acceptance_by_depth(2) == [0.75, 0.5]
    assert st.acceptance_by_depth(5) == [0.75, 0.5, 0.5, 0.0, 0.0]
    assert sum(st.acceptance_by_depth()) == pytest.approx(st.mal - 1)  # shares sum to MAL - 1


def test_merge_equals_folding_every_event_into_one() -> None:
    a, b = (
        _speculative_request(),
        [
            StepEvent([1], verify_s=0.1, prefill=True),
            StepEvent(
                [2, 3, 4, 5, 6], accepted=4, draft_s=0.2, verify_s=0.1, round_s=0.4, vocab=_vocab(5, 5)
            ),
        ],
    )
    merged = _fold(a, RequestStats(vocab=VocabTotals(latencies=[])))
    merged.merge(_fold(b))
    whole = _fold(a + b, RequestStats(vocab=VocabTotals(latencies=[])))
    assert merged.depth_counts == whole.depth_counts == [4, 3, 3, 1]
    assert (merged.tokens, merged.rounds, merged.accepted) == (whole.tokens, whole.rounds, whole.accepted)
    assert merged.mal == whole.mal == pytest.approx((5 + 11) / 5)
    assert merged.acceptance_by_depth() == whole.acceptance_by_depth() == [0.8, 0.6, 0.6, 0.2]
    for name in ("draft_s", "verify_s", "prefill_s", "round_s"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name))
    assert merged.vocab == whole.vocab and merged.vocab.latencies == [0.01]


def test_copy_shares_nothing_mutable() -> None:
    st = _fold(_speculative_request(), RequestStats(vocab=VocabTotals(latencies=[])))
    snap = st.copy()
    st.add(StepEvent([1, 2, 3, 4, 5], accepted=4, vocab=_vocab(5, 5, [0.02])))
    assert snap.depth_counts == [3, 2, 2] and snap.vocab.rounds == 3 and snap.vocab.latencies == [0.01]
    assert st.depth_counts == [4, 3, 3, 1] and st.vocab.latencies == [0.01, 0.02]


def test_rounds_are_counted_by_who_proposed_their_tokens() -> None:
    """Drafted (a draft model proposed), model-free (context lookup / n-gram table), or the root
    alone (an ngram round with no guess, an AR step): neither count."""
    events = [
        StepEvent([1], verify_s=0.1, prefill=True),
        StepEvent([2, 3], accepted=1, tree_size=2),  # drafted
        StepEvent([4, 5, 6], accepted=2, tree_size=3, looked_up=True),  # a lookup's chain
        StepEvent([7], tree_size=1, looked_up=True),  # a table guess, rejected
        StepEvent([8], looked_up=True),  # nothing proposed: the root alone
        StepEvent([9]),  # an AR step
    ]
    st = _fold(events)
    assert (st.rounds, st.drafted, st.model_free) == (5, 1, 2)
    half = _fold(events[:3])
    half.merge(_fold(events[3:]))
    assert (half.drafted, half.model_free) == (1, 2)

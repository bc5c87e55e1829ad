"""StopRule: stop ids kept in the output, length budget, and events' defaults."""

from __future__ import annotations

from evospec.decoding.events import StepEvent, StopRule


def test_stop_id_is_kept_and_ends() -> None:
    rule = StopRule(frozenset({9}), max_new_tokens=10)
    assert rule.clip([1, 9, 2], produced=0) == ([1, 9], "stop")
    assert rule.clip([9], produced=5) == ([9], "stop")


def test_no_stop_continues() -> None:
    rule = StopRule(frozenset({9}), max_new_tokens=10)
    assert rule.clip([1, 2, 3], produced=0) == ([1, 2, 3], None)


def test_length_budget() -> None:
    rule = StopRule(frozenset(), max_new_tokens=4)
    assert rule.clip([1, 2, 3], produced=0) == ([1, 2, 3], None)
    assert rule.clip([1, 2, 3], produced=1) == ([1, 2, 3], "length")
    assert rule.clip([1, 2, 3], produced=2) == ([1, 2], "length")


def test_stop_id_beyond_the_budget_is_ignored() -> None:
    rule = StopRule(frozenset({9}), max_new_tokens=3)
    assert rule.clip([1, 2, 9], produced=1) == ([1, 2], "length")
    assert rule.clip([1, 9, 9], produced=1) == ([1, 9], "stop")


def test_step_event_defaults() -> None:
    ev = StepEvent(tokens=[5])
    assert (ev.accepted, ev.tree_size, ev.draft_s, ev.verify_s, ev.finish_reason) == (0, 0, 0.0, 0.0, None)

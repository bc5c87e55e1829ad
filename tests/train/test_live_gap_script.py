"""``scripts/live_gap.py``: the chain-round replay that turns teacher-forced predictions into
what live rounds accept (checked against live runs in docs/draft-head.md, wave 21)."""

from __future__ import annotations

import pytest

from tests.script_modules import load_script


def _replay():
    return load_script("live_gap").replay


def test_every_draft_right_accepts_whole_chains_and_the_verify_adds_one() -> None:
    replay = _replay()
    # 8 answer tokens: token 0 from the prefill; rounds root at 0 (accept 1-3, verify 4), then at
    # 4 (accept 5-7; the answer ends, so no verify token is counted past it)
    assert replay(lambda r, s: True, 8, 3) == [3, 3]
    assert replay(lambda r, s: True, 8, 1) == [1, 1, 1, 1]  # roots 0, 2, 4, 6


def test_a_wrong_first_draft_makes_a_plain_round() -> None:
    replay = _replay()
    assert replay(lambda r, s: False, 5, 3) == [0, 0, 0, 0]  # one verified token per round


def test_rounds_root_after_the_accepted_tokens_so_positions_are_skipped() -> None:
    replay = _replay()
    wrong_at = {2}  # a chain rooted at token 2 is wrong at once; every other chain is right
    got = replay(lambda r, s: r not in wrong_at, 6, 1)
    # root 0 accepts token 1 (the verify adds 2); root 2 misses (verify adds 3); root 3 accepts
    # 4 (verify adds 5): the chain rooted at 1 is never drafted
    assert got == [1, 0, 1]


def test_a_chain_stops_at_its_first_wrong_token() -> None:
    replay = _replay()
    got = replay(lambda r, s: s < 3, 9, 3)  # the third token of every chain is wrong
    assert got == [2, 2, 2]  # roots 0, 3, 6; the last round accepts 7 and 8


def test_drawing_from_a_draft_like_the_target_is_accepted_where_its_top_token_is_not() -> None:
    import math

    import torch

    accept = load_script("live_gap").proposal_acceptance
    p = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])  # the target at T=1
    point, drawn = accept(p, p, 1.0)  # the draft equals the target
    assert point == pytest.approx(0.5) and drawn == pytest.approx(1.0)
    sure = torch.tensor([[20.0, 0.0, 0.0]])  # a draft sure of the target's top token
    point, drawn = accept(p, sure, 1.0)
    assert point == pytest.approx(0.5) and drawn == pytest.approx(0.5, abs=1e-6)
    # summed over positions, at another temperature: the same softmaxes at T on both sides
    both = torch.cat([p, p]) * 2.0
    assert accept(both, both, 2.0) == pytest.approx((1.0, 2.0))

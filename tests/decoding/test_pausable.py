"""Pausable steps: a pause closes what the steps hold suspended before the driver's work runs,
a timing a pause interrupted is measured again, and tuning driven with pauses chooses as
tuning without them."""

from __future__ import annotations

import time

from evospec.decoding import pausable, tune
from evospec.decoding.events import StepEvent
from evospec.decoding.pausable import DONE, LATE, PAUSED
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig

SLOW, FAST = TreeConfig(top_k=1, depth=2, total_tokens=2), TreeConfig(top_k=2, depth=3, total_tokens=6)


class Clock:
    """The driver's side: ``epoch`` counts its pauses (other work on the model)."""

    epoch = 0


class Logged:
    """A decoder writing one token per ``delay`` seconds that records, per generate call, the
    driver epochs its events were written in and whether it was closed."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls: list[dict] = []

    def generate(self, prompt, params):
        call = {"epochs": set(), "closed": False, "tokens": 0}
        self.calls.append(call)
        try:
            for _ in range(params.max_new_tokens):
                time.sleep(self.delay)
                call["epochs"].add(Clock.epoch)
                call["tokens"] += 1
                yield StepEvent(tokens=[1])
        finally:
            call["closed"] = True

    def close(self) -> None:
        pass


def drive_pausing(steps, at: range):
    """Drive ``steps``, pausing at the yields numbered in ``at``: the driver's work (an epoch)
    runs at the clean point the steps yield after a pause, as the engine serves a request there.
    (A pause more often than a timed run lasts would starve it, as a server busy all the time
    starves its idle work.)"""
    n = 0
    try:
        next(steps)
        while True:
            n += 1
            if n not in at:
                steps.send(False)
                continue
            steps.send(True)  # pause: the steps give back the model, yield at a clean point
            Clock.epoch += 1  # other work runs
            steps.send(False)  # resume
    except StopIteration as stop:
        return stop.value


def test_drive_runs_steps_to_their_value():
    def steps():
        assert not (yield)
        assert not (yield from pausable.checkpoint())
        return 7

    assert pausable.drive(steps()) == 7


def test_a_checkpoint_yields_once_more_when_paused():
    gen = pausable.checkpoint()
    next(gen)
    gen.send(True)  # the clean point: still suspended
    try:
        gen.send(False)
    except StopIteration as stop:
        assert stop.value is True


def test_a_pause_closes_the_decode_before_the_drivers_work():
    dec = Logged(0.0)
    gen = pausable.decode(dec, [1], SamplingParams(max_new_tokens=10))
    next(gen)
    next(gen)
    try:
        gen.send(True)
    except StopIteration as stop:
        assert stop.value == (2, PAUSED)
    assert dec.calls[0]["closed"] and dec.calls[0]["tokens"] == 2


def test_a_decode_past_its_instant_stops_late():
    gen = pausable.decode(Logged(0.01), [1], SamplingParams(max_new_tokens=50), stop_at=time.perf_counter())
    assert pausable.drive(gen) == (1, LATE)
    assert pausable.drive(pausable.decode(Logged(0.0), [1], SamplingParams(max_new_tokens=3))) == (3, DONE)


def test_a_paused_run_is_timed_again_from_its_first_prompt():
    """Two prompts of 5 tokens; the pause falls in the second prompt of the first run: that run
    is void, the second run writes all 10 tokens, each of its decodes within one epoch."""
    dec = Logged(0.001)
    tokens, seconds = drive_pausing(
        pausable.timed(dec, [[1], [2]], SamplingParams(max_new_tokens=5)), at=range(7, 8)
    )
    assert tokens == 10 and seconds > 0
    assert [c["tokens"] for c in dec.calls] == [5, 2, 5, 5]
    assert all(c["closed"] and len(c["epochs"]) == 1 for c in dec.calls)


def test_tuning_driven_with_pauses_chooses_as_without():
    """Calibration paused every 17th yield (a timed run is 12) still keeps FAST (1.5x SLOW's
    speed, 1.67x AR's), and no decoder ever wrote events on both sides of a pause: a run a pause
    cut was closed, not resumed."""
    delays = {SLOW: 0.009, FAST: 0.006}
    built = []

    def build(tree):
        built.append(Logged(delays[tree]))
        return built[-1]

    ar, start = Logged(0.01), Clock.epoch
    steps = tune.calibrate_steps(
        build, ar, [[1], [2]], candidates=[SLOW, FAST], max_new_tokens=6, progress=False
    )
    res = drive_pausing(steps, at=range(5, 10_000, 17))
    assert TreeConfig(**res["tree"]) == FAST and 1.2 < res["speedup"] < 2.2
    calls = [c for dec in (ar, *built) for c in dec.calls]
    assert len(calls) > 20 and all(c["closed"] and len(c["epochs"]) == 1 for c in calls)
    assert Clock.epoch - start >= 5  # it did pause, many times

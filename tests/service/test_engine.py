"""The engine thread without HTTP: cancelled-before-start requests never reach the decoder,
a stop drains the queue with SHUTDOWN, a broken listener or sink does not kill the thread."""

from __future__ import annotations

import threading

import pytest

from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from service.engine import Done, Engine, EngineStopped, GenerationRequest, Outcome
from tests.service.helpers import GateDecoder, WrappedDecoder, wait_for


class Collect:
    def __init__(self) -> None:
        self.items: list = []
        self.done = threading.Event()

    def __call__(self, item) -> None:
        self.items.append(item)
        if isinstance(item, Done):
            self.done.set()

    @property
    def outcome(self) -> Outcome:
        return self.items[-1].outcome


class Counting(WrappedDecoder):
    calls = 0

    def generate(self, prompt, params):
        self.calls += 1
        return super().generate(prompt, params)


def _req(n: int = 3, timeout: float = 30.0) -> GenerationRequest:
    return GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=n), timeout_s=timeout)


def test_submit_needs_a_running_engine(tiny, codec) -> None:
    engine = Engine(make_decoder("ar", tiny, eos_ids=codec.eos_ids))
    with pytest.raises(EngineStopped):
        engine.submit(_req(), Collect())


def test_cancelled_and_expired_requests_never_run(tiny, codec) -> None:
    gate = GateDecoder(make_decoder("ar", tiny, eos_ids=codec.eos_ids))
    dec = Counting(gate)
    engine = Engine(dec, max_queue=4)
    engine.start()
    try:
        first, second, third = Collect(), Collect(), Collect()
        engine.submit(_req(), first)
        assert wait_for(lambda: engine.snapshot().active)
        r2, r3 = _req(), _req(timeout=1e-6)  # r3 expires while queued
        engine.submit(r2, second)
        engine.submit(r3, third)
        r2.cancel(Outcome.DISCONNECTED)
        gate.gate.set()
        assert first.done.wait(10) and second.done.wait(10) and third.done.wait(10)
        assert first.outcome is Outcome.FINISHED and len(first.items) == 4
        assert second.outcome is Outcome.DISCONNECTED and len(second.items) == 1
        assert third.outcome is Outcome.TIMEOUT and len(third.items) == 1
        assert dec.calls == 1
    finally:
        engine.stop()


def test_stop_drains_the_queue_with_shutdown(tiny, codec) -> None:
    gate = GateDecoder(make_decoder("ar", tiny, eos_ids=codec.eos_ids))
    engine = Engine(gate, max_queue=4)
    engine.start()
    running, queued = Collect(), Collect()
    engine.submit(_req(50), running)
    assert wait_for(lambda: engine.snapshot().active)
    engine.submit(_req(), queued)
    threading.Timer(0.2, gate.gate.set).start()
    engine.stop()
    assert running.done.is_set() and running.outcome is Outcome.SHUTDOWN
    assert queued.done.is_set() and queued.outcome is Outcome.SHUTDOWN
    assert not engine.alive


def test_broken_listener_and_sink_do_not_kill_the_thread(tiny, codec) -> None:
    def bad_listener(done: Done) -> None:
        raise RuntimeError("listener bug")

    def bad_sink(item) -> None:
        raise RuntimeError("event loop is closed")

    engine = Engine(make_decoder("ar", tiny, eos_ids=codec.eos_ids), listeners=[bad_listener])
    engine.start()
    try:
        engine.submit(_req(20), bad_sink)  # an unreachable handler counts as a disconnect
        ok = Collect()
        engine.submit(_req(), ok)
        assert ok.done.wait(10) and ok.outcome is Outcome.FINISHED
        snap = engine.snapshot()
        assert snap.alive and snap.outcomes["disconnected"] == 1 and snap.outcomes["finished"] == 1
    finally:
        engine.stop()


def test_start_with_prepare_builds_the_decoder_on_the_engine_thread(tiny, codec) -> None:
    """Serving builds (loads, tunes) on the thread that then runs the model."""
    built_on = []

    def prepare():
        built_on.append(threading.current_thread())
        return make_decoder("ar", tiny, eos_ids=codec.eos_ids)

    engine = Engine(max_queue=2)
    engine.start(prepare)
    try:
        assert engine.method == "ar" and built_on == [engine._thread]
        sink = Collect()
        engine.submit(_req(), sink)
        assert sink.done.wait(30) and sink.outcome is Outcome.FINISHED
        engine.start()  # already running: a no-op (the app's lifespan calls it again)
    finally:
        engine.stop()


def test_start_raises_what_prepare_raised_and_serves_nothing() -> None:
    def prepare():
        raise ValueError("no such model")

    engine = Engine()
    with pytest.raises(ValueError, match="no such model"):
        engine.start(prepare)
    assert not engine.alive
    with pytest.raises(ValueError, match="needs start"):
        Engine().start()

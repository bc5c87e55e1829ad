"""Idle work on the engine thread: it runs only while no request waits, is paused (holding
nothing on the model) before each request, hands over the decoder it chooses, and a failing or
unfinished job never costs a request."""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence

import torch

from evospec.decoding import pausable
from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from service.engine import Engine, GenerationRequest, Outcome
from service.idle import IdleJob
from tests.service.helpers import WrappedDecoder, ar_ids, wait_for
from tests.service.test_engine import Collect


class Epochs(WrappedDecoder):
    """Records, for each generate call, the number of requests the engine had finished at each of
    its events (a call seeing two numbers ran on both sides of a request)."""

    def __init__(self, inner, finished: list[int]) -> None:
        super().__init__(inner)
        self.finished = finished
        self.calls: list[set[int]] = []
        self.closed = False

    def generate(self, prompt: Sequence[int], params: SamplingParams):
        self.calls.append(set())
        return super().generate(prompt, params)

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        self.calls[-1].add(self.finished[0])

    def close(self) -> None:
        self.closed = True
        super().close()


def _timing_job(worker, runs: int, result, done, name: str = "timing test"):
    def steps():
        for _ in range(runs):
            yield from pausable.timed(worker, [[5, 6, 7]], SamplingParams(max_new_tokens=6))
        return result

    return IdleJob(name, steps(), done)


def test_idle_work_gives_way_to_requests_then_serves_its_choice(tiny, codec) -> None:
    finished = [0]
    served = Epochs(make_decoder("ar", tiny, eos_ids=codec.eos_ids), finished)
    worker = Epochs(make_decoder("ar", tiny, eos_ids=codec.eos_ids), finished)
    chosen = make_decoder("ngram", tiny, eos_ids=codec.eos_ids, tree=TreeConfig(1, 1, 1, lookup=3))
    engine = Engine(served, listeners=[lambda done: finished.__setitem__(0, finished[0] + 1)])
    results = []
    engine.start()
    try:
        engine.run_when_idle(_timing_job(worker, 150, "ngram", lambda r: results.append(r) or chosen))
        assert engine.snapshot().idle_work == "timing test"
        sinks = []
        for i in range(4):
            assert wait_for(lambda n=i: len(worker.calls) > 10 * (n + 1))  # the job got going again
            sinks.append(Collect())
            engine.submit(
                GenerationRequest([1, 2, 3 + i], SamplingParams(max_new_tokens=8), timeout_s=30), sinks[-1]
            )
            assert sinks[-1].done.wait(10)
        assert wait_for(lambda: engine.method == "ngram", timeout=60)
        assert results == ["ngram"] and served.closed and engine.snapshot().idle_work is None
        for i, sink in enumerate(sinks):
            tokens = [t for item in sink.items[:-1] for t in item.tokens]
            assert sink.outcome is Outcome.FINISHED and tokens == ar_ids(tiny, codec, [1, 2, 3 + i], 8)
        # every run of the job's decoder happened between two requests, never across one
        assert len(worker.calls) >= 150 and all(len(seen) == 1 for seen in worker.calls)
        assert {n for seen in worker.calls for n in seen} == {0, 1, 2, 3, 4}
        after = Collect()
        engine.submit(GenerationRequest([9, 8, 7], SamplingParams(max_new_tokens=8), timeout_s=30), after)
        assert after.done.wait(10) and [t for item in after.items[:-1] for t in item.tokens] == ar_ids(
            tiny, codec, [9, 8, 7], 8
        )
    finally:
        engine.stop()


def test_a_failing_job_is_dropped_and_the_engine_serves_on(tiny, codec, caplog) -> None:
    engine = Engine(make_decoder("ar", tiny, eos_ids=codec.eos_ids))

    def steps():
        yield
        raise RuntimeError("injected tuning failure")

    engine.start()
    try:
        engine.run_when_idle(IdleJob("doomed", steps(), lambda r: None))
        assert wait_for(lambda: engine.snapshot().idle_work is None)
        sink = Collect()
        engine.submit(GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=4), timeout_s=30), sink)
        assert sink.done.wait(10) and sink.outcome is Outcome.FINISHED and engine.method == "ar"
        assert "doomed failed; serving ar as before" in caplog.text
    finally:
        engine.stop()


def test_stopping_closes_unfinished_work(tiny, codec) -> None:
    closed = threading.Event()
    engine = Engine(make_decoder("ar", tiny, eos_ids=codec.eos_ids))

    def steps():
        try:
            while True:
                yield from pausable.checkpoint()
        finally:
            closed.set()

    engine.start()
    engine.run_when_idle(IdleJob("endless", steps(), lambda r: None))
    engine.stop()
    assert closed.is_set() and engine.method == "ar"


def test_a_server_answers_at_once_while_method_auto_is_timed(tmp_path, tiny, codec, monkeypatch) -> None:
    """``serve --method auto`` on a machine without its timings: ngram serves from the start,
    the timings run in idle time (here a fake calibration that lasts until the test lets it
    end), the chosen method serves after, and the next start reads the cached choice."""
    import indices.default
    from evospec.decoding import tune
    from evospec.models.eagle import new_eagle_for, save_eagle
    from service.config import ServeConfig
    from service.server import build
    from tests.indices.helpers import write_model_folder

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(indices.default, "ensure_indices", _no_indices)
    gate, calibrated = threading.Event(), []

    def fake_calibrate(build, ar, prompts, candidates, **kw):
        calibrated.append(candidates)
        while not gate.wait(0.002):  # timing, pausable, until the test lets it end
            yield from pausable.checkpoint()
        speedup = 1.5 if len(calibrated) == 2 else 1.0  # the second method: eagle2
        tree = {"top_k": 1, "depth": 1, "total_tokens": 1}
        return {"tree": tree, "tok_per_s": speedup, "ar_tok_per_s": 1.0, "speedup": speedup, "table": []}

    def fake_final(ar, decoders, prompts, **kw):
        yield
        return {n: 1.4 if n == "eagle2" else 1.0 for n in decoders}

    monkeypatch.setattr(tune, "calibrate_steps", fake_calibrate)
    monkeypatch.setattr(tune, "final_steps", fake_final)
    import evospec.assembly as assembly_mod

    trims = []  # the heap handed back: after loading, and after the timed candidates are dropped
    monkeypatch.setattr(assembly_mod, "trim_heap", lambda: trims.append("trim") or True)
    folder = write_model_folder(tmp_path / "tiny-folder", tiny, codec)
    head = save_eagle(new_eagle_for(tiny, seed=3), tmp_path / "head", dtype=torch.float32)
    config = ServeConfig(model=str(folder), method="auto", draft=str(head), weights="fp32")
    log = io.StringIO()
    built = build(config, progress=False, log=log)
    engine = built.engine
    try:
        assert engine.method == "ngram" and "serving ngram (context lookup" in log.getvalue()
        assert trims == ["trim"]  # at the end of the assembly
        assert wait_for(lambda: engine.snapshot().idle_work == "method auto: timing the candidates")
        ids = codec.encode("The quick brown fox")
        sink = Collect()
        engine.submit(GenerationRequest(ids, SamplingParams(max_new_tokens=10), timeout_s=30), sink)
        assert sink.done.wait(10) and [t for it in sink.items[:-1] for t in it.tokens] == ar_ids(
            tiny, codec, ids, 10
        )
        gate.set()
        assert wait_for(lambda: engine.method == "eagle2", timeout=30)
        assert "method auto: eagle2 (measured speedup over ar: nanospec 1.00x, eagle2 1.40x" in log.getvalue()
        assert "now serving eagle2" in log.getvalue() and len(calibrated) == 3
        assert len(trims) == 2  # and once the choice replaced the provisional decoder
    finally:
        engine.stop()
    log = io.StringIO()
    again = build(config, progress=False, log=log)  # the next start: cached, nothing deferred
    try:
        assert again.engine.method == "eagle2" and again.engine.snapshot().idle_work is None
        assert "method auto: eagle2 (measured" in log.getvalue() and len(calibrated) == 3
    finally:
        again.engine.stop()


def test_a_served_methods_tree_auto_is_timed_beside_serving(tmp_path, tiny, codec, monkeypatch) -> None:
    """``serve --method eagle2`` (tree auto: the default) without the timing: eagle2 serves at
    once at a 1-token chain after context lookup, then at the shape the timing chose, keeping
    the JSON guesses asked for; later starts read it."""
    from evospec.decoding import tune
    from evospec.models.eagle import new_eagle_for, save_eagle
    from service.config import ServeConfig
    from service.server import build
    from tests.indices.helpers import write_model_folder

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path / "home"))
    gate, calibrated = threading.Event(), []

    def fake_calibrate(build, ar, prompts, candidates, **kw):
        calibrated.append(candidates)
        while not gate.wait(0.002):
            yield from pausable.checkpoint()
        tree = {"top_k": 2, "depth": 3, "total_tokens": 6}
        return {"tree": tree, "tok_per_s": 1.3, "ar_tok_per_s": 1.0, "speedup": 1.3, "table": []}

    monkeypatch.setattr(tune, "calibrate_steps", fake_calibrate)
    folder = write_model_folder(tmp_path / "tiny-folder", tiny, codec)
    head = save_eagle(new_eagle_for(tiny, seed=3), tmp_path / "head", dtype=torch.float32)
    json_guesses = TreeConfig(jump_forward=2)  # no shape: the tree is still measured
    config = ServeConfig(
        model=str(folder), method="eagle2", draft=str(head), weights="fp32", tree=json_guesses
    )
    log = io.StringIO()
    engine = build(config, progress=False, log=log).engine
    try:
        assert engine.method == "eagle2"
        assert engine.decoder.tree == TreeConfig(1, 1, 1, lookup=3, jump_forward=2)
        assert wait_for(lambda: engine.snapshot().idle_work == "tree auto for eagle2: timing the shapes")
        first = engine.decoder
        gate.set()
        assert wait_for(lambda: engine.decoder is not first, timeout=30)
        assert engine.method == "eagle2" and engine.decoder.tree == TreeConfig(2, 3, 6, jump_forward=2)
        assert (
            "tree auto for eagle2: eagle2 (measured speedup over ar: eagle2 1.30x); tree "
            f"{TreeConfig(2, 3, 6)}; now serving eagle2" in log.getvalue()
        )
        ids = codec.encode("The quick brown fox")
        sink = Collect()
        engine.submit(GenerationRequest(ids, SamplingParams(max_new_tokens=10), timeout_s=30), sink)
        assert sink.done.wait(10) and [t for it in sink.items[:-1] for t in it.tokens] == ar_ids(
            tiny, codec, ids, 10
        )
    finally:
        engine.stop()
    log = io.StringIO()
    again = build(config, progress=False, log=log).engine  # cached: no idle work
    try:
        assert f"tree auto for eagle2: {TreeConfig(2, 3, 6)} (the shape measured fastest" in log.getvalue()
        assert again.decoder.tree == TreeConfig(2, 3, 6, jump_forward=2)
        assert again.snapshot().idle_work is None
        assert len(calibrated) == 1
    finally:
        again.stop()


def _no_indices(*args, **kwargs):
    raise FileNotFoundError("no shared data folder")

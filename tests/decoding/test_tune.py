"""--tree auto: the tuner keeps the fastest measured shape, says whether it beats AR, and caches."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from evospec.decoding import tune
from evospec.decoding.events import StepEvent
from evospec.decoding.tree import TreeConfig
from evospec.models.packing import PackedLinear
from tests.decoding.spec_helpers import steps_of

SLOW, FAST = TreeConfig(top_k=1, depth=2, total_tokens=2), TreeConfig(top_k=2, depth=3, total_tokens=6)


class _Sleepy:
    """A decoder emitting one token per ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def generate(self, prompt, params):
        for _ in range(params.max_new_tokens):
            time.sleep(self.delay)
            yield StepEvent(tokens=[1])

    def close(self) -> None:
        self.closed = True


def test_calibrate_picks_the_fastest_shape_and_compares_with_ar():
    delays = {SLOW: 0.02, FAST: 0.002}
    res = tune.calibrate(
        lambda t: _Sleepy(delays[t]),
        _Sleepy(0.01),
        [[1, 2]],
        candidates=[SLOW, FAST],
        max_new_tokens=5,
        progress=False,
    )
    assert TreeConfig(**res["tree"]) == FAST
    assert res["beats_ar"] and res["tok_per_s"] > res["ar_tok_per_s"]
    assert [row["tree"]["total_tokens"] for row in res["table"]] == [2, 6]


def test_calibrate_keeps_each_sides_best_run_through_a_burst_of_noise():
    """One AR run and one FAST run fall into a burst at a third of the speed: the best runs
    still say FAST is 1.67x AR and SLOW 1.11x; AR was timed in every pass. (The gap between
    the two is wide so that sleep jitter on a loaded CI machine cannot swap them.)"""
    phase = iter([1, 1, 1, 1, 3, 1, 1, 1, 3, 1])  # 3 warm-ups, AR's first run, (AR, FAST, SLOW) per pass
    runs = []

    class Bursty(_Sleepy):
        def generate(self, prompt, params):
            factor = next(phase)
            runs.append(self.delay)
            for _ in range(params.max_new_tokens):
                time.sleep(self.delay * factor)
                yield StepEvent(tokens=[1])

    delays = {FAST: 0.006, SLOW: 0.009}  # vs AR 0.01: FAST 1.67x, SLOW 1.11x
    res = tune.calibrate(
        lambda t: Bursty(delays[t]),
        Bursty(0.01),
        [[1]],
        candidates=[FAST, SLOW],
        max_new_tokens=6,
        progress=False,
    )
    assert runs[3:] == [0.01] + [0.01, 0.006, 0.009] * 2
    assert TreeConfig(**res["tree"]) == FAST and 1.3 < res["speedup"] < 2.0
    assert res["table"][0]["speedup"] > res["table"][1]["speedup"] > 1.0


def test_later_passes_skip_hopeless_shapes():
    """A shape at a fifth of the leader's speed is timed in the first pass only (PRUNE 0.4)."""
    calls = {SLOW: 0, FAST: 0}

    class Counted(_Sleepy):
        def __init__(self, tree) -> None:
            super().__init__({SLOW: 0.02, FAST: 0.004}[tree])
            self.tree = tree

        def generate(self, prompt, params):
            calls[self.tree] += 1
            yield from super().generate(prompt, params)

    res = tune.calibrate(
        Counted, _Sleepy(0.01), [[1]], candidates=[SLOW, FAST], max_new_tokens=3, progress=False
    )
    assert calls == {SLOW: 2, FAST: 3}  # a warm-up each; SLOW once, FAST twice
    assert TreeConfig(**res["tree"]) == FAST


class _ByPrompt(_Sleepy):
    """A decoder whose delay per token depends on the prompt's first id: one speed on the
    calibration prompt (1), another on the final's (2)."""

    def __init__(self, delays: dict[int, float]) -> None:
        super().__init__(0.0)
        self.delays = delays

    def generate(self, prompt, params):
        self.delay = self.delays[prompt[0]]
        yield from super().generate(prompt, params)


MID = TreeConfig(top_k=1, depth=1, total_tokens=1)


def test_the_leading_shapes_play_a_final_that_picks_the_tree():
    """FAST leads the calibration (2.5x AR), SLOW is close behind (2.38x) and MID far off
    (1.25x); on the final's prompt FAST is slower than AR and SLOW twice as fast: the final,
    not the calibration, picks SLOW, and MID does not play."""
    delays = {FAST: {1: 0.004, 2: 0.012}, SLOW: {1: 0.0042, 2: 0.005}, MID: {1: 0.008, 2: 0.001}}
    played = []

    def build(tree):
        dec = _ByPrompt(delays[tree])
        dec.tree = tree
        return dec

    real_final = tune.final_steps

    def spy(ar, decoders, prompts, **kw):
        played.append(sorted(d.tree.total_tokens for d in decoders.values()))
        return (yield from real_final(ar, decoders, prompts, **kw))

    ar = _ByPrompt({1: 0.01, 2: 0.01})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune, "final_steps", spy)
        res = tune.calibrate(
            build, ar, [[1]], candidates=[FAST, SLOW, MID], max_new_tokens=4, progress=False,
            final_prompts=[[2]],
        )  # fmt: skip
    assert played == [[2, 6]]  # SLOW and FAST; MID below TREE_FINAL_SHARE of the leader
    assert TreeConfig(**res["tree"]) == SLOW and 1.5 < res["speedup"] < 2.5 and res["beats_ar"]
    fast, slow, mid = res["table"]
    assert fast["final_speedup"] < 1.0 < slow["final_speedup"] and "final_speedup" not in mid
    assert fast["speedup"] > slow["speedup"]  # the calibration's own figures stay in the table


def test_a_lone_leader_plays_no_final():
    res = tune.calibrate(
        lambda t: _Sleepy({SLOW: 0.02, FAST: 0.002}[t]), _Sleepy(0.01), [[1]], candidates=[SLOW, FAST],
        max_new_tokens=3, progress=False, final_prompts=[[2]],
    )  # fmt: skip
    assert TreeConfig(**res["tree"]) == FAST and all("final_speedup" not in row for row in res["table"])


def test_calibrate_reports_when_no_shape_beats_ar():
    res = tune.calibrate(
        lambda t: _Sleepy(0.01), _Sleepy(0.001), [[1]], candidates=[SLOW], max_new_tokens=4, progress=False
    )
    assert not res["beats_ar"]


def _calibrated(tree: dict) -> dict:
    """What ``calibrate`` returns, for a fake that picked ``tree`` at 2x AR."""
    return {"tree": tree, "tok_per_s": 2.0, "ar_tok_per_s": 1.0, "beats_ar": True, "table": []}


def _loaded() -> SimpleNamespace:
    """A loaded model as the tuner reads it: name, no weights, a codec for the prompts."""
    codec = SimpleNamespace(encode_chat=lambda msgs: [1, 2, 3])
    return SimpleNamespace(name="tiny", model=None, codec=codec, weights="fp32")


def test_tuned_tree_is_cached_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    calls = []

    def fake_calibrate(build, ar, prompts, **kw):
        calls.append(len(prompts))
        assert len(kw["final_prompts"]) == len(tune.FINAL_TEXTS)  # the leading shapes play a final
        return _calibrated({"top_k": 3, "depth": 4, "total_tokens": 10})

    monkeypatch.setattr(tune, "calibrate_steps", steps_of(fake_calibrate))
    loaded = _loaded()
    for _ in range(2):
        tree = tune.Tuner(lambda m, t: None, loaded, "h", progress=False).tree("nanospec")
        assert tree == TreeConfig(top_k=3, depth=4, total_tokens=10)
    assert calls == [tune.CALIBRATION_PROMPTS]  # the second call read the cache
    assert (tmp_path / "tuning" / "trees.json").exists()
    tune.Tuner(lambda m, t: None, loaded, "h", progress=False).tree("frspec")
    assert len(calls) == 2  # another method, another key
    loaded.model = SimpleNamespace(lm_head=PackedLinear(torch.nn.Linear(2, 2)))
    tune.Tuner(lambda m, t: None, loaded, "h", progress=False).tree("nanospec")
    assert len(calls) == 3  # packed weights verify at other costs: tuned again
    tune.Tuner(lambda m, t: None, loaded, "h", verify_logits="all", progress=False).tree("nanospec")
    assert len(calls) == 4  # projecting every node changes what a big tree costs: tuned again
    loaded.weights = "int4"
    tune.Tuner(lambda m, t: None, loaded, "h", progress=False).tree("nanospec")
    assert len(calls) == 5  # another weight format, another cost curve: tuned again
    loaded.model.step_graph = object()
    tune.Tuner(lambda m, t: None, loaded, "h", progress=False).tree("nanospec")
    assert len(calls) == 6  # recorded steps make AR cheaper: the bar moves, tuned again
    tune.Tuner(lambda m, t: None, loaded, "h|draft-int8", progress=False).tree("nanospec")
    assert len(calls) == 7  # an int8 draft drafts at another cost: tuned again


def test_machine_key_names_the_hardware():
    key = tune.machine_key()
    assert key.startswith(("cpu:", "cuda:")) and len(key) > 6


class _Flaky(_Sleepy):
    """Slow during its first timed pass only (a noisy neighbour: 2x slower than SLOW, as bursts
    here were, so not pruned), fast afterwards."""

    def __init__(self) -> None:
        super().__init__(0.001)
        self.calls = 0

    def generate(self, prompt, params):
        self.calls += 1
        self.delay = 0.02 if self.calls == 2 else 0.001  # call 1 is the warm-up
        yield from super().generate(prompt, params)


def test_each_shape_keeps_its_best_pass():
    res = tune.calibrate(
        lambda t: _Flaky() if t == FAST else _Sleepy(0.01),
        _Sleepy(0.005),
        [[1]],
        candidates=[SLOW, FAST],
        max_new_tokens=4,
        progress=False,
    )
    assert TreeConfig(**res["tree"]) == FAST and res["beats_ar"]


def test_a_models_ngram_table_adds_its_shapes_to_the_candidates(tmp_path, monkeypatch):
    assert not any(t.table_lookup for m in ("ngram", "frspec") for t in tune.candidates_for(m))
    for method in ("ngram", "frspec"):
        with_table = tune.candidates_for(method, table=True)
        assert any(t.table_lookup for t in with_table) and any(t.lookup for t in with_table)
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    seen = []

    def fake_calibrate(build, ar, prompts, candidates, **kw):
        seen.append(candidates)
        return _calibrated({"top_k": 1, "depth": 1, "total_tokens": 1, "lookup": 3, "table_lookup": 1})

    monkeypatch.setattr(tune, "calibrate_steps", steps_of(fake_calibrate))
    loaded = _loaded()
    tree = tune.Tuner(lambda m, t: None, loaded, "h|ngrams-t", progress=False, table=True).tree("ngram")
    assert tree.table_lookup == 1 and seen == [tune.NGRAM_TABLE_CANDIDATES]


def test_a_method_without_a_draft_finds_its_shape_whichever_head_was_loaded(tmp_path, monkeypatch):
    """ngram's timings depend on the n-gram table, not on a head: a shape measured where a head was
    loaded beside it (serve --method auto, bench --methods frspec,ngram) is found where none was
    (generate --method ngram), and the other way round; a drafted method's still follows its head."""
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    calls = []

    def fake_calibrate(build, ar, prompts, **kw):
        calls.append(1)
        return _calibrated({"top_k": 1, "depth": 1, "total_tokens": 1, "lookup": 3, "table_lookup": 1})

    monkeypatch.setattr(tune, "calibrate_steps", steps_of(fake_calibrate))
    loaded = _loaded()

    def tuner(drafts: str) -> tune.Tuner:
        return tune.Tuner(
            lambda m, t: None, loaded, drafts, progress=False, table=True, plain_id="no-draft|ngrams-t"
        )

    tuner("h|draft-int4|ngrams-t").tree("ngram")
    tuner("none|draft-int8|ngrams-t").tree("ngram")
    assert len(calls) == 1  # the second found the first's shape
    tuner("h|draft-int4|ngrams-t").tree("frspec")
    tuner("g|draft-int4|ngrams-t").tree("frspec")
    assert len(calls) == 3  # a drafted method: another head, another key


def test_a_run_still_going_after_the_leaders_time_over_prune_is_stopped():
    """Every candidate writes AR's tokens, so a run that has taken 1 / PRUNE x the leader's time
    cannot reach PRUNE x its speed: it is stopped there, and scored below PRUNE x the leader."""
    emitted = {SLOW: 0}

    class Counted(_Sleepy):
        def __init__(self, tree) -> None:
            super().__init__({SLOW: 0.05, FAST: 0.002}[tree])
            self.tree = tree

        def generate(self, prompt, params):
            for ev in super().generate(prompt, params):
                emitted[self.tree] = emitted.get(self.tree, 0) + 1
                yield ev

    res = tune.calibrate(
        Counted, _Sleepy(0.004), [[1], [2]], candidates=[FAST, SLOW], max_new_tokens=10, progress=False
    )
    # SLOW: 4 warm-up tokens, then the first pass stops it after ~(20 tokens x 2 ms) / 0.4 =
    # 100 ms, i.e. ~2-3 of its 20 tokens (unstopped: all 20); no second pass (pruned)
    assert emitted[SLOW] - 4 < 10
    slow = next(row for row in res["table"] if TreeConfig(**row["tree"]) == SLOW)
    assert slow["tok_per_s"] < tune.PRUNE * res["tok_per_s"] and TreeConfig(**res["tree"]) == FAST


def test_calibration_times_with_the_live_cache_only_and_gives_the_store_back():
    """Calibration repeats its prompts: no decoder may copy an earlier visit's slots back from
    its prefix store while it is timed (AR, timed most, would gain most); afterwards the
    decoders keep their store's room."""
    seen = []

    class _Stored(_Sleepy):
        def __init__(self, delay: float) -> None:
            super().__init__(delay)
            self.prefix = SimpleNamespace(store_bytes=256 << 20)

        def generate(self, prompt, params):
            seen.append(self.prefix.store_bytes)
            yield from super().generate(prompt, params)

    ar = _Stored(0.002)
    tune.calibrate(
        lambda t: _Stored(0.001), ar, [[1, 2]], candidates=[SLOW], max_new_tokens=2, progress=False
    )
    assert seen and set(seen) == {0}
    assert ar.prefix.store_bytes == 256 << 20


def test_the_final_interleaves_ar_and_the_finalists_and_keeps_each_prompts_best_run():
    """Two prompts, two rounds: each prompt is decoded by AR and both finalists in an order that
    rotates by one; a burst at a third of the speed hits one of A's runs and one of AR's, and
    the best runs still say A 2x AR, B 1.25x."""
    order, runs = [], iter(range(100))
    burst = {4, 10}  # run numbers (0-2 are the warm-ups) that fall into the burst

    class Logged(_Sleepy):
        def __init__(self, name: str, delay: float) -> None:
            super().__init__(delay)
            self.name = name

        def generate(self, prompt, params):
            n = next(runs)
            if n >= 3:
                order.append((self.name, prompt[0]))
            for _ in range(params.max_new_tokens):
                time.sleep(self.delay * (3 if n in burst else 1))
                yield StepEvent(tokens=[1])

    ar, a, b = Logged("ar", 0.01), Logged("a", 0.005), Logged("b", 0.008)
    speedups = tune.final(ar, {"a": a, "b": b}, [[0], [1]], max_new_tokens=4, rounds=2, progress=False)
    assert order == [
        ("ar", 0),
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("ar", 1),  # round 1
        ("b", 0),
        ("ar", 0),
        ("a", 0),
        ("ar", 1),
        ("a", 1),
        ("b", 1),  # round 2
    ]  # runs 4 (a, prompt 0, round 1) and 10 (ar, prompt 0, round 2) were slowed
    assert set(speedups) == {"a", "b"}
    assert 1.6 < speedups["a"] < 2.4 and 1.05 < speedups["b"] < 1.5


def _method_tuner(monkeypatch, calibrated: dict, played: dict | None, seen: list) -> tune.Tuner:
    """A tuner whose calibrations report ``calibrated`` and whose final reports ``played``."""

    def fake_tuning(self, method):
        tree = {"top_k": 1, "depth": 1, "total_tokens": 1}
        return {"tree": tree, "tok_per_s": calibrated[method], "ar_tok_per_s": 1.0}

    def fake_final(self, names, trees):
        seen.append(list(names))
        return {n: played[n] for n in names}

    monkeypatch.setattr(tune.Tuner, "tuning_steps", steps_of(fake_tuning))
    monkeypatch.setattr(tune.Tuner, "final_steps", steps_of(fake_final))
    return tune.Tuner(lambda m, t: None, _loaded(), "h", progress=False)


def test_method_auto_lets_the_interleaved_final_decide(monkeypatch):
    seen: list = []
    calibrated = {"frspec": 1.08, "ngram": 1.06, "eagle2": 1.07, "nanospec": 0.9}
    tuner = _method_tuner(monkeypatch, calibrated, {"frspec": 1.02, "eagle2": 1.11}, seen)
    chosen, tree, speedups = tuner.method(list(calibrated))
    assert seen == [["frspec", "eagle2"]]  # the two leaders (FINALISTS) play the final
    assert chosen == "eagle2" and tree == TreeConfig(top_k=1, depth=1, total_tokens=1)
    assert speedups == {"frspec": 1.02, "ngram": 1.06, "eagle2": 1.11, "nanospec": 0.9}


def test_only_a_finalist_can_win_method_auto(monkeypatch):
    """A third method's calibration (1.09x) above what the final measured for the two leaders
    does not make it the choice: the final corrects calibrations, and it did not play."""
    seen: list = []
    calibrated = {"frspec": 1.12, "ngram": 1.11, "eagle2": 1.09}
    tuner = _method_tuner(monkeypatch, calibrated, {"frspec": 1.04, "ngram": 1.07}, seen)
    assert tuner.method(list(calibrated))[0] == "ngram" and seen == [["frspec", "ngram"]]


def test_method_auto_falls_back_to_ar_when_the_final_says_no_method_pays(monkeypatch):
    seen: list = []
    tuner = _method_tuner(monkeypatch, {"frspec": 1.09, "ngram": 1.07}, {"frspec": 1.03, "ngram": 1.04}, seen)
    assert tuner.method(["frspec", "ngram"])[:2] == ("ar", None)
    assert seen == [["frspec", "ngram"]]
    seen.clear()  # nothing calibrated at FINAL_FLOOR: no final is played
    tuner = _method_tuner(monkeypatch, {"frspec": 0.9, "ngram": 0.94}, None, seen)
    assert tuner.method(["frspec", "ngram"])[0] == "ar" and seen == []


def test_the_final_is_cached_per_finalists(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    built, calls = [], []

    def fake_final(ar, decoders, prompts, **kw):
        calls.append((len(prompts), sorted(decoders)))
        return {n: 1.2 for n in decoders}

    def build(method, tree):
        built.append((method, tree))
        return _Sleepy(0.0)

    monkeypatch.setattr(tune, "final_steps", steps_of(fake_final))
    monkeypatch.setattr(tune, "ARDecoder", lambda model, eos: _Sleepy(0.0))
    trees = {"ngram": TreeConfig(1, 1, 1, lookup=3), "frspec": TreeConfig(1, 2, 2)}
    for _ in range(2):
        assert tune.Tuner(build, _loaded(), "h", progress=False).final(["ngram", "frspec"], trees) == {
            "ngram": 1.2,
            "frspec": 1.2,
        }
    assert calls == [(len(tune.FINAL_TEXTS), ["frspec", "ngram"])]  # the second read the cache
    assert built == [("ngram", trees["ngram"]), ("frspec", trees["frspec"])]
    tune.Tuner(build, _loaded(), "h", progress=False).final(["ngram"], trees)
    assert len(calls) == 2  # other finalists, another final
    recalibrated = {**trees, "frspec": TreeConfig(1, 1, 1)}
    tune.Tuner(build, _loaded(), "h", progress=False).final(["ngram", "frspec"], recalibrated)
    assert len(calls) == 3  # a finalist's tree measured again to another shape: another final


def test_calibrate_closes_the_decoders_it_built():
    built = []

    def build(tree):
        built.append(_Sleepy(0.001))
        return built[-1]

    tune.calibrate(build, _Sleepy(0.001), [[1]], candidates=[SLOW, FAST], max_new_tokens=2, progress=False)
    assert len(built) == 2 and all(getattr(d, "closed", False) for d in built)


def test_tuning_a_model_without_a_tokenizer_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    loaded = _loaded()
    loaded.codec = None
    tuner = tune.Tuner(lambda m, t: _Sleepy(0.0), loaded, "h", progress=False)
    for measure in (lambda: tuner.tuning("frspec"), lambda: tuner.final(["ngram"], {"ngram": SLOW})):
        with pytest.raises(ValueError, match="needs a model with a tokenizer"):
            measure()
    assert not (tmp_path / "tuning" / "trees.json").exists()  # nothing cached

"""The per-machine prefetch choice: measured once and cached per model and machine, a named hint
set without measuring, models without the loops left alone; and its timing of a real step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from evospec.kernels import prefetch as hints_mod
from evospec.models import prefetch
from tests.conftest import tiny_models


@pytest.fixture
def fake_hints(monkeypatch, tmp_path):
    """The op library's hints as a dict, an empty cache root, and every model taking a hint."""
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    state = {"streamed": "nta", "kept": "t0"}
    monkeypatch.setattr(hints_mod, "set_hints", lambda s, k="t0": state.update(streamed=s, kept=k))
    monkeypatch.setattr(hints_mod, "hints", lambda: (state["streamed"], state["kept"]))
    monkeypatch.setattr(prefetch, "applies", lambda loaded: True)
    monkeypatch.setattr(prefetch, "_key", lambda loaded: f"{loaded.name}|this machine")
    return state


def test_auto_measures_once_then_reads_the_cache(fake_hints, monkeypatch, tmp_path):
    calls = []

    def measure(loaded):
        calls.append(loaded.name)
        return {"nta": 8.7, "t0": 3.3, "t1": 3.4, "none": 4.5}

    monkeypatch.setattr(prefetch, "measure", measure)
    model = SimpleNamespace(name="m")
    first = prefetch.choose_prefetch(model)
    assert (first.hint, first.cached, fake_hints["streamed"]) == ("t0", False, "t0")
    line = "weight prefetch: t0 (3.30 ms a step; none 4.50, nta 8.70, t1 3.40; measured now, cached)"
    assert first.describe() == line
    fake_hints["streamed"] = "nta"  # a new process starts with the library's default
    again = prefetch.choose_prefetch(model)
    assert (again.hint, again.cached, fake_hints["streamed"]) == ("t0", True, "t0")
    assert calls == ["m"]  # measured once
    cache = json.loads((tmp_path / "tuning" / "prefetch.json").read_text())
    assert cache == {"m|this machine": {"hint": "t0", "ms": {"nta": 8.7, "t0": 3.3, "t1": 3.4, "none": 4.5}}}
    prefetch.choose_prefetch(SimpleNamespace(name="other"))
    assert calls == ["m", "other"]  # another model: its own entry


def test_an_unreadable_cache_is_measured_again(fake_hints, monkeypatch, tmp_path):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "prefetch.json").write_text("{not json")
    monkeypatch.setattr(prefetch, "measure", lambda loaded: {"nta": 8.0, "t0": 3.0})
    choice = prefetch.choose_prefetch(SimpleNamespace(name="m"))
    assert (choice.hint, choice.cached) == ("t0", False)
    assert json.loads((tmp_path / "tuning" / "prefetch.json").read_text())["m|this machine"]["hint"] == "t0"


def test_a_close_call_keeps_nta(fake_hints, monkeypatch):
    monkeypatch.setattr(prefetch, "measure", lambda loaded: {"nta": 3.05, "t0": 3.0, "t1": 3.1, "none": 3.6})
    assert prefetch.choose_prefetch(SimpleNamespace(name="m")).hint == "nta"


def test_a_named_hint_is_set_without_measuring(fake_hints, monkeypatch, tmp_path):
    monkeypatch.setattr(prefetch, "measure", lambda loaded: pytest.fail("measured"))
    choice = prefetch.choose_prefetch(SimpleNamespace(name="m"), "t1")
    assert (choice.hint, fake_hints["streamed"], fake_hints["kept"]) == ("t1", "t1", "t0")
    assert choice.describe() == "weight prefetch: t1 (as given)"
    assert not (tmp_path / "tuning").exists()
    with pytest.raises(ValueError, match="--prefetch 'fast': use auto or one of"):
        prefetch.choose_prefetch(SimpleNamespace(name="m"), "fast")


def test_models_without_the_loops_have_no_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    fp32 = SimpleNamespace(weights="fp32", model=None)
    assert not prefetch.applies(fp32)
    assert prefetch.choose_prefetch(fp32) is None
    assert not (tmp_path / "tuning").exists()


@pytest.mark.skipif(not hints_mod.available(), reason="no int8-activation kernels here")
def test_measure_times_a_real_quantised_step(tmp_path):
    from evospec.models.loading import load_model

    tiny_models("llama", seed=5).hf.save_pretrained(str(tmp_path))
    loaded = load_model(tmp_path, weights="int8", progress=False)
    assert prefetch.applies(loaded)
    before = hints_mod.hints()
    try:
        ms = prefetch.measure(loaded, rounds=1, calls=2)
    finally:
        hints_mod.set_hints(*before)
    assert set(ms) == set(hints_mod.CANDIDATES) and all(v > 0 for v in ms.values())

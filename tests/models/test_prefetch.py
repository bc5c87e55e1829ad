"""The per-machine prefetch choice: measured once and cached per model and machine, a named setting
applied without measuring, models without the loops left alone; and its timing of a real step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from evospec.kernels import prefetch as hints_mod
from evospec.models import prefetch
from tests.conftest import tiny_models


def S(name: str) -> hints_mod.Setting:
    return hints_mod.Setting.parse(name)


def timed(**named: float) -> dict:
    """Timings by setting, from keywords: t1_10=2.6 is t1:10."""
    return {S(k.replace("_", ":")): v for k, v in named.items()}


@pytest.fixture
def fake_hints(monkeypatch, tmp_path):
    """The op library's streamed setting in a dict, an empty cache root, and every model taking one."""
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    state = {"streamed": hints_mod.DEFAULT}
    monkeypatch.setattr(hints_mod, "apply", lambda s: state.update(streamed=s))
    monkeypatch.setattr(prefetch, "applies", lambda loaded: True)
    monkeypatch.setattr(prefetch, "_key", lambda loaded: f"{loaded.name}|this machine")
    return state


def test_auto_measures_once_then_reads_the_cache(fake_hints, monkeypatch, tmp_path):
    calls = []

    def measure(loaded):
        calls.append(loaded.name)
        return timed(nta=8.7, t0=3.3, t0_10=2.9, t1_10=2.7, none=4.5)

    monkeypatch.setattr(prefetch, "measure", measure)
    model = SimpleNamespace(name="m")
    first = prefetch.choose_prefetch(model)
    assert (first.setting, first.cached, fake_hints["streamed"]) == (S("t1:10"), False, S("t1:10"))
    assert first.describe() == (
        "weight prefetch: t1:10 (2.70 ms a step of 5 settings timed; default nta:2.5 8.70; "
        "measured now, cached)"
    )
    fake_hints["streamed"] = hints_mod.DEFAULT  # a new process starts with the library's default
    again = prefetch.choose_prefetch(model)
    assert (again.setting, again.cached, fake_hints["streamed"]) == (S("t1:10"), True, S("t1:10"))
    assert again.describe().endswith("cached for this machine)")
    assert calls == ["m"]  # measured once
    cache = json.loads((tmp_path / "tuning" / "prefetch.json").read_text())
    ms = {"nta:2.5": 8.7, "t0:2.5": 3.3, "t0:10": 2.9, "t1:10": 2.7, "none": 4.5}
    assert cache == {"m|this machine": {"setting": "t1:10", "ms": ms}}
    prefetch.choose_prefetch(SimpleNamespace(name="other"))
    assert calls == ["m", "other"]  # another model: its own entry


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"m|this machine": {"hint": "t0"}}', '{"m|this machine": {"setting": "l2", "ms": {}}}'],
)
def test_an_unreadable_cache_or_entry_is_measured_again(fake_hints, monkeypatch, tmp_path, content):
    (tmp_path / "tuning").mkdir()
    (tmp_path / "tuning" / "prefetch.json").write_text(content)
    monkeypatch.setattr(prefetch, "measure", lambda loaded: timed(nta=8.0, t0=3.0))
    choice = prefetch.choose_prefetch(SimpleNamespace(name="m"))
    assert (choice.setting, choice.cached) == (S("t0"), False)
    entry = json.loads((tmp_path / "tuning" / "prefetch.json").read_text())["m|this machine"]
    assert entry["setting"] == "t0:2.5"


def test_a_close_call_keeps_the_default(fake_hints, monkeypatch):
    monkeypatch.setattr(prefetch, "measure", lambda loaded: timed(nta=3.05, t0=3.0, t1_10=3.02, none=3.6))
    assert prefetch.choose_prefetch(SimpleNamespace(name="m")).setting == hints_mod.DEFAULT


def test_a_named_setting_is_applied_without_measuring(fake_hints, monkeypatch, tmp_path):
    monkeypatch.setattr(prefetch, "measure", lambda loaded: pytest.fail("measured"))
    for name, setting in (("t1", S("t1:2.5")), ("t1:10", S("t1:10"))):
        choice = prefetch.choose_prefetch(SimpleNamespace(name="m"), name)
        assert (choice.setting, fake_hints["streamed"]) == (setting, setting)
    assert choice.describe() == "weight prefetch: t1:10 (as given)"
    assert not (tmp_path / "tuning").exists()
    with pytest.raises(ValueError, match=r"--prefetch 'fast': use auto or HINT\[:KIB\]"):
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
    before = hints_mod.current()
    try:
        ms = prefetch.measure(loaded, rounds=1, calls=2)
    finally:
        hints_mod.apply(before)
    assert set(ms) == set(hints_mod.CANDIDATES) and all(v > 0 for v in ms.values())

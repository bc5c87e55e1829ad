"""``scripts/pause_cost.py``: a recorded step's time by the pause before it (wave 26)."""

from __future__ import annotations

import pytest

from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import tiny_target
from tests.script_modules import load_script


def test_pause_costs_time_each_pause_in_each_pass_and_leave_the_cache_as_it_was():
    script = load_script("pause_cost")
    model = tiny_target(2)
    cache = model.new_cache(24)
    calls = []
    rows = script.pause_costs(
        StepGraph(model), cache, 20, [0, 0.5], repeats=2, calls=7, product=lambda: calls.append(1)
    )
    assert list(rows) == [0, 0.5]
    for r in rows.values():
        assert len(r["spin"]) == len(r["busy"]) == len(r["product"]) == 2
        assert all(t > 0 for t in r["spin"] + r["busy"])
    assert len(calls) == 2 * 2 * 7  # every pause, every pass
    assert cache.length == 20
    empty = script.pause_costs(StepGraph(model), cache, 20, [0], repeats=1, calls=6)
    assert empty[0]["product"] == []


def test_counts_below_one_are_refused_before_anything_loads(monkeypatch, capsys):
    script = load_script("pause_cost")
    monkeypatch.setattr("sys.argv", ["pause_cost.py", "--calls", "0"])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    assert exit_.value.code == 2 and "--calls" in capsys.readouterr().err

"""``scripts/choices.py``: its summary (medians, the cost of n choices in units of one, the
batched server's speed-up) and its argument checks."""

from __future__ import annotations

import pytest

from tests.script_modules import SCRIPTS, load_script


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports concurrency and serve_vs_llamacpp beside it
    return load_script("choices")


def test_summary_takes_medians_and_ratios(script):
    times = {
        "--max-batch 1": {1: [1.0, 1.2, 0.8], 4: [4.0, 4.4]},
        "--max-batch 4": {1: [1.0, 1.1], 4: [2.0, 2.2, 2.1]},
    }
    table, result = script.summary(times, 4)
    assert result["medians"]["--max-batch 1"][4] == pytest.approx(4.2)
    assert result["speedup"] == pytest.approx(4.2 / 2.1)
    assert "**4.20**" in table and "**2.00x**" in table


def test_one_choice_is_not_a_comparison(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--n", "1"])

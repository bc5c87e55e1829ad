"""``scripts/first_start.py``: its summary of a first start (the server it drives is the one
scripts/serve_vs_llamacpp.py starts)."""

from __future__ import annotations

import pytest

from tests.script_modules import SCRIPTS, load_script


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports serve_vs_llamacpp beside it
    return load_script("first_start")


def _row(timing, method, total, ttft, text="same", ok=True):
    return {"timing": timing, "method": method, "ok": ok, "total_s": total, "ttft_s": ttft, "text": text}


def test_the_summary_splits_requests_by_whether_the_idle_work_was_running(script):
    rows = [
        _row(True, "ngram", 0.3, 0.01),
        _row(True, "ngram", 0.5, 0.10),
        _row(True, "ngram", 9.0, 9.0, text="", ok=False),  # failed: left out of the medians
        _row(True, "ngram", 0.4, 0.02),
        _row(False, "frspec", 0.2, 0.03),
    ]
    summary = script.summarize(rows, ready_s=10.0, ended_s=200.0)
    assert summary["ready_s"] == 10.0 and summary["idle_work_ended_s"] == 200.0 and summary["requests"] == 5
    timing, after = summary["while_timing"], summary["after"]
    assert timing == {"requests": 3, "methods": ["ngram"], "median_total_s": 0.4, "median_ttft_s": 0.02}
    assert after == {"requests": 1, "methods": ["frspec"], "median_total_s": 0.2, "median_ttft_s": 0.03}
    assert summary["one_text"]
    rows.append(_row(False, "frspec", 0.2, 0.03, text="other"))
    assert not script.summarize(rows, 1.0, None)["one_text"]


def test_no_request_in_a_phase_leaves_its_medians_empty(script):
    summary = script.summarize([_row(False, "ngram", 0.3, 0.01)], ready_s=200.0, ended_s=200.0)
    assert summary["while_timing"] == {
        "requests": 0,
        "methods": [],
        "median_total_s": None,
        "median_ttft_s": None,
    }

"""``scripts/concurrency.py``: its prompt pool, summary and text comparison (the servers and
clients it drives are the ones scripts/serve_vs_llamacpp.py uses)."""

from __future__ import annotations

import json

import pytest

from tests.script_modules import SCRIPTS, load_script


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports serve_vs_llamacpp beside it
    return load_script("concurrency")


def test_prompts_take_categories_in_turn_and_cycle(script, tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [("a", "a1"), ("a", "a2"), ("b", "b1"), ("c", "c1"), ("a", "a3")]
    path.write_text("\n".join(json.dumps({"category": c, "turns": [t, "later"]}) for c, t in rows))
    assert script.load_prompts(path, 4) == ["a1", "b1", "c1", "a2"]
    assert script.load_prompts(path, 7) == ["a1", "b1", "c1", "a2", "a3", "a1", "b1"]  # cycles
    calibration = script.load_prompts(tmp_path / "missing.jsonl", 2)
    assert len(calibration) == 2 and all(isinstance(t, str) and t for t in calibration)


def test_summary_takes_medians_over_rounds_and_ratios_of_them(script):
    def run(tok_s, latency):
        keys = [k for k, _, _ in script.COLUMNS]
        return dict(zip(keys, (tok_s, latency, 0.5, 9, 0.1, 0.2), strict=True))

    runs = {"one": [run(100, 2.0), run(120, 1.0), run(90, 3.0)], "many": [run(150, 1.0), run(210, 1.5)]}
    table, summary = script.summary_table(["one", "many"], runs)
    assert summary["medians"]["one"]["throughput_tok_s"] == 100
    assert summary["ratio"]["throughput_tok_s"] == pytest.approx(180 / 100)
    assert summary["ratio"]["mean_latency_s"] == pytest.approx(1.25 / 2.0)
    assert "**1.80**" in table and "100.0 / 120.0 / 90.0" in table


def test_texts_are_compared_by_round_and_prompt(script):
    runs = [{"results": [{"prompt_index": 0, "text": "x"}, {"prompt_index": 1, "text": "y"}]},
            {"results": [{"prompt_index": 0, "text": "z"}]}]  # fmt: skip
    assert script._texts(runs) == {(0, 0): "x", (0, 1): "y", (1, 0): "z"}


def test_arguments_must_be_positive(script):
    with pytest.raises(SystemExit):
        script.parse_args(["--clients", "0"])
    assert script.parse_args(["--max-batch", "3"]).max_batch == 3

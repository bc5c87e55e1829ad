"""Training prompts: the shared folder's training-side sets and/or prompt files, never evaluation sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.train.prompts import select_sources, training_prompts


def _write(path: Path, prompts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps({"prompt": p, "extra": 1}) for p in prompts) + "\n")
    return path


def test_prompt_files_are_sources_interleaved_round_robin(tmp_path: Path) -> None:
    a = _write(tmp_path / "law.jsonl", ["a0", "a1", "a2"])
    b = _write(tmp_path / "med.jsonl", ["b0"])
    got = training_prompts([a, b], seed=1)
    assert sorted(p.text for p in got) == ["a0", "a1", "a2", "b0"]
    assert {p.source for p in got[:2]} == {"law", "med"}  # any prefix is balanced across sources
    assert len({p.uid for p in got}) == 4 and all(p.uid.split(":")[0] == p.source for p in got)
    assert training_prompts([a, b], seed=1) == got  # seeded


@pytest.mark.parametrize("name", ["spec_bench/question.jsonl", "humaneval/prompts.jsonl", "gsm8k/test.jsonl"])
def test_evaluation_sets_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="evaluation sets"):
        training_prompts([_write(tmp_path / name, ["x"])])


def test_bad_files_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such training data"):
        training_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="record 1 has no string 'prompt'"):
        training_prompts(bad)


def test_select_sources_keeps_their_prompts_in_mixed_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "law.jsonl", ["a0", "a1"])
    b = _write(tmp_path / "med.jsonl", ["b0", "b1"])
    c = _write(tmp_path / "chat.jsonl", ["c0"])
    mixed = training_prompts([a, b, c], seed=3)
    got = select_sources(mixed, ["law", "chat"])
    assert got == [p for p in mixed if p.source != "med"]
    assert select_sources(mixed, None) == mixed
    with pytest.raises(ValueError, match=r"unknown prompt source\(s\) \['lwa'\]"):
        select_sources(mixed, ["lwa"])

"""Benchmark prompt files: Spec-Bench, HumanEval, PubMedQA and plain {"prompt": ...} JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.bench.prompts import BenchPrompt, load_prompts


def _write(path: Path, records: list[dict], blank_lines: bool = False) -> Path:
    sep = "\n\n" if blank_lines else "\n"
    path.write_text(sep.join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.fixture
def spec_bench(tmp_path: Path) -> Path:
    records = [
        {"question_id": i, "category": cat, "turns": [f"{cat} question {i}", "a follow-up turn"]}
        for i, cat in enumerate(["writing", "writing", "writing", "math", "math", "coding"])
    ]
    return _write(tmp_path / "question.jsonl", records, blank_lines=True)


def test_spec_bench_format(spec_bench: Path) -> None:
    prompts = load_prompts(spec_bench)
    assert len(prompts) == 6
    assert prompts[0] == BenchPrompt("writing", "writing question 0", True)  # first turn, chat
    assert [p.category for p in prompts] == ["writing"] * 3 + ["math"] * 2 + ["coding"]


def test_plain_prompt_format(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "plain.jsonl",
        [
            {"prompt": "hello"},
            {"prompt": "def f():", "chat": False, "category": "code"},
        ],
    )
    assert load_prompts(path) == [
        BenchPrompt("default", "hello", True),
        BenchPrompt("code", "def f():", False),
    ]


def test_per_category_keeps_file_order(spec_bench: Path) -> None:
    prompts = load_prompts(spec_bench, per_category=2)
    assert [p.text for p in prompts] == [
        "writing question 0",
        "writing question 1",
        "math question 3",
        "math question 4",
        "coding question 5",
    ]


def test_limit_and_both(spec_bench: Path) -> None:
    assert [p.text for p in load_prompts(spec_bench, limit=2)] == ["writing question 0", "writing question 1"]
    both = load_prompts(spec_bench, per_category=1, limit=2)
    assert [p.category for p in both] == ["writing", "math"]
    assert load_prompts(spec_bench, limit=100) == load_prompts(spec_bench)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent\.jsonl"):
        load_prompts(tmp_path / "absent.jsonl")


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: invalid JSON"):
        load_prompts(path)


def test_record_without_prompt_or_turns(tmp_path: Path) -> None:
    path = _write(tmp_path / "odd.jsonl", [{"text": "nope"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl:1: expected a Spec-Bench \('turns'\)"):
        load_prompts(path)


def test_several_files_humaneval_and_pubmedqa(spec_bench: Path, tmp_path: Path) -> None:
    """Records in the shared data's own formats; per_category spans all files."""
    humaneval = _write(
        tmp_path / "prompts.jsonl",
        [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(3)],
    )
    pubmed = _write(
        tmp_path / "pqal.jsonl",
        [{"pubid": "1", "question": "Does it work?", "contexts": ["First part.", "Second part."]}],
    )
    prompts = load_prompts([spec_bench, humaneval, pubmed], per_category=2)
    assert [p.category for p in prompts] == ["writing"] * 2 + ["math"] * 2 + ["coding"] + [
        "humaneval"
    ] * 2 + ["pubmedqa"]
    assert prompts[5] == BenchPrompt(
        "humaneval", "Complete this Python function.\n\n```python\ndef f0():\n```", True
    )
    assert prompts[7].text == "First part. Second part.\n\nQuestion: Does it work?\nAnswer briefly."
    assert load_prompts([humaneval], limit=1) == load_prompts(humaneval, limit=1)


class _Codec:  # records which rendering a prompt asked for
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        assert messages == [{"role": "user", "content": "hi"}]
        return [1, 2]

    def encode(self, text: str) -> list[int]:
        assert text == "hi"
        return [3]


def test_token_ids_renders_chat_prompts_with_the_template_and_plain_ones_as_text() -> None:
    assert BenchPrompt("qa", "hi", True).token_ids(_Codec()) == [1, 2]
    assert BenchPrompt("qa", "hi", False).token_ids(_Codec()) == [3]

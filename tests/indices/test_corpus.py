"""Corpora: the training-side reader yields whole documents and never an evaluation set; corpus
files are read by type, and paths inside evaluation-only folders are refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.common import DEFAULT_DATA
from indices.corpus import EvalDataError, eval_only_match, read_corpus_files, training_texts

needs_data = pytest.mark.skipif(not DEFAULT_DATA.is_dir(), reason="shared data folder not present")


@needs_data
def test_training_texts_have_answers_and_no_eval_text() -> None:
    gsm = list(training_texts(DEFAULT_DATA, sources=["gsm8k_train"]))
    assert len(gsm) == 7473
    assert all("\n#### " in t for t in gsm)  # question and its worked answer, one document
    test_q = json.loads((DEFAULT_DATA / "gsm8k/test.jsonl").open().readline())["question"]
    assert not any(t.startswith(test_q) for t in gsm)
    si = list(training_texts(DEFAULT_DATA, sources=["self_instruct"]))
    assert any("oatmeal banana protein shake" in t for t in si)  # an instance output
    tr = list(training_texts(DEFAULT_DATA, sources=["flores200_deen", "tatoeba_deen", "ntrex128_deen"]))
    assert len(tr) == 2 * (1012 + 17565 + 1997)  # both sides, one sentence per document


@needs_data
def test_training_texts_refuse_eval_folder_and_unknown_source() -> None:
    with pytest.raises(EvalDataError, match="spec_bench"):
        next(training_texts(DEFAULT_DATA / "spec_bench"))
    with pytest.raises(ValueError, match="unknown training sources"):
        next(training_texts(DEFAULT_DATA, sources=["humaneval"]))


@needs_data
def test_shared_eval_paths_refused_but_gsm8k_train_allowed() -> None:
    for bad in (
        "spec_bench",
        "humaneval/prompts.jsonl",
        "pubmedqa",
        "mt_bench",
        "gsm8k",
        "gsm8k/test.jsonl",
        ".",
    ):
        with pytest.raises(EvalDataError, match="evaluation-only"):
            next(read_corpus_files([DEFAULT_DATA / bad]))
    assert next(read_corpus_files([DEFAULT_DATA / "gsm8k/train.jsonl"])).startswith("Natalia")


def test_eval_only_match_by_folder_and_stem(tmp_path: Path) -> None:
    assert eval_only_match(tmp_path / "data" / "humaneval" / "x.jsonl") == "humaneval"
    assert eval_only_match(tmp_path / "gsm8k" / "test.jsonl") == "gsm8k/test"
    assert eval_only_match(tmp_path / "gsm8k" / "train.jsonl") is None
    assert eval_only_match(tmp_path / "my_humaneval_notes.txt") is None


def test_read_corpus_files_by_type(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond\n\n\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"text": "from text", "other": "ignored"})
        + "\n\n"
        + json.dumps({"q": "Q?", "a": ["A1", {"x": "A2"}], "n": 3})
        + "\n"
    )
    (tmp_path / "c.json").write_text(json.dumps([{"text": "one"}, "two"]))
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "d.txt").write_text("nested")
    (sub / "skip.bin").write_bytes(b"\x00")
    docs = list(read_corpus_files([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.json"]))
    assert docs == ["first paragraph\nstill first", "second", "from text", "Q?\n\nA1\n\nA2", "one", "two"]
    assert list(read_corpus_files([tmp_path / "a.txt"], paragraphs=False)) == [
        "first paragraph\nstill first\n\nsecond\n\n\n"
    ]
    assert list(read_corpus_files([tmp_path]))[-1] == "nested"  # folders: sorted, recursive, by suffix


def test_read_corpus_files_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        next(read_corpus_files([tmp_path / "nope.txt"]))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unknown corpus file type"):
        next(read_corpus_files([tmp_path / "x.csv"]))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        next(read_corpus_files([tmp_path / "bad.jsonl"]))
    evil = tmp_path / "mt_bench"
    evil.mkdir()
    (evil / "q.txt").write_text("an evaluation question")
    (tmp_path / "ok.txt").write_text("fine")
    with pytest.raises(EvalDataError, match="mt_bench"):  # refused before anything is yielded
        next(read_corpus_files([tmp_path / "ok.txt", tmp_path]))


@needs_data
def test_every_training_source_has_its_license_beside_it() -> None:
    from indices.corpus import TRAINING_SOURCES, source_commit

    for name, s in TRAINING_SOURCES.items():
        folder = DEFAULT_DATA / s.folder
        assert any((folder / f).is_file() for f in ("LICENSE", "LICENSE_NOTE.txt")), name
        assert len(source_commit(DEFAULT_DATA, name)) == 40, name
        assert next(training_texts(DEFAULT_DATA, sources=[name])).strip(), name

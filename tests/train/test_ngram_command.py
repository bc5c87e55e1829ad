"""`evospec build-ngrams` end to end: train-draft's generated answers in, a table serving reads out."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evospec.cli import main
from evospec.decoding.ngram_table import NgramTable, load_ngram_table
from tests.train.test_cli import _argv, model  # noqa: F401  (the tiny model folder fixture)


def test_the_generated_answers_become_the_models_table(model: Path, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path / "home"))
    assert main(_argv(model, tmp_path, "--generate-only")) == 0
    work = tmp_path / "work"
    assert main(["build-ngrams", "--target", str(model), "--work", str(work), "--no-progress"]) == 0
    out = tmp_path / "home" / "ngrams" / "model.safetensors"  # the default place, by model name
    table = load_ngram_table(out)
    answers = [json.loads(x) for x in (work / "generations.jsonl").read_text().splitlines()]
    assert table.info.sequences == len(answers) and table.info.model == "model" and len(table) > 0
    assert table.info.tokens == sum(len(a["response_ids"]) + min(3, len(a["prompt_ids"])) for a in answers)
    # exactly the prompt tails + answers were counted
    seqs = [[*a["prompt_ids"][-3:], *a["response_ids"]] for a in answers]
    want = NgramTable.count(seqs, model="model", vocab_size=table.info.vocab_size)
    assert torch.equal(table.keys, want.keys) and torch.equal(table.next_ids, want.next_ids)


def test_no_generated_answers_says_how_to_make_them(model: Path, tmp_path: Path, capsys) -> None:  # noqa: F811
    argv = ["build-ngrams", "--target", str(model), "--work", str(tmp_path / "empty"), "--no-progress"]
    assert main(argv) == 2
    assert "train-draft" in capsys.readouterr().err

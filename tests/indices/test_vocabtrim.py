"""VocabTrim's table: counted from the target's own answers, listed and verified like the other
index files, shipped for the default model, and the policy's top ids at FR-Spec's size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from indices.build import build_indices
from indices.frequency import load_counts
from indices.manifest import VOCABTRIM_FILE, IndexLoadError, Manifest, load_indices
from indices.packaged import PACKAGED_ROOT, read_packaged
from indices.vocabtrim import add_vocabtrim, count_generations
from tests.decoding.spec_helpers import tiny_target
from tests.indices.helpers import random_docs

VOCAB = 64


def _generations(path: Path, answers: list[list[int]], torn: bool = False) -> Path:
    lines = [
        json.dumps({"uid": f"u{i}", "prompt_ids": [1], "response_ids": a}) for i, a in enumerate(answers)
    ]
    path.write_text("\n".join(lines) + ('\n{"uid": "cut' if torn else "\n"))
    return path


def test_counts_are_the_answers_tokens(tmp_path: Path) -> None:
    path = _generations(tmp_path / "g.jsonl", [[3, 3, 5], [5, 7]], torn=True)
    counts, info = count_generations([path], VOCAB)
    assert counts[3] == 2 and counts[5] == 2 and counts[7] == 1 and counts.sum() == 5
    assert info == {"origin": "g.jsonl", "sequences": 2, "tokens": 5, "distinct_ids": 3}


def test_sources_filter_what_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "g.jsonl"
    path.write_text(
        json.dumps({"source": "oasst", "response_ids": [1, 2]})
        + "\n"
        + json.dumps({"source": "t0", "response_ids": [3]})
    )
    counts, info = count_generations([path], VOCAB, sources={"oasst"})
    assert counts.sum() == 2 and counts[3] == 0
    assert info["source_tokens"] == {"oasst": 2} and info["left_out_tokens"] == {"t0": 1}


def test_bad_generations_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"uid": 1}\n{"response_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        count_generations([bad], VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        count_generations([_generations(tmp_path / "big.jsonl", [[99]])], VOCAB)
    with pytest.raises(FileNotFoundError):
        count_generations([tmp_path / "none.jsonl"], VOCAB)


def test_the_table_is_listed_verified_and_loaded(tmp_path: Path) -> None:
    weight = tiny_target(0, vocab=VOCAB).lm_head.weight.detach().clone()
    out = tmp_path / "idx"
    build_indices(weight, random_docs(30, VOCAB), out, model_name="tiny", progress=False, hnsw_threads=1)
    assert load_indices(out, weight, need_hnsw=False).vocabtrim is None  # optional
    counts, info = count_generations([_generations(tmp_path / "g.jsonl", [[4, 4, 9]])], VOCAB)
    m = add_vocabtrim(out, weight, counts, info, command="evospec-index vocabtrim ...")
    assert VOCABTRIM_FILE in m.files and m.vocabtrim["tokens"] == 3
    assert Manifest.from_dict(json.loads((out / "manifest.json").read_text())) == m
    bundle = load_indices(out, weight, need_hnsw=False)
    assert np.array_equal(bundle.vocabtrim, counts)
    (out / VOCABTRIM_FILE).write_bytes((out / VOCABTRIM_FILE).read_bytes()[:-8])  # truncated
    with pytest.raises(IndexLoadError, match=VOCABTRIM_FILE):
        load_indices(out, weight, need_hnsw=False)
    with pytest.raises(ValueError, match="shape"):
        add_vocabtrim(out, weight, counts[:10], info)


def test_a_table_ships_for_the_default_model_and_differs_from_frspecs() -> None:
    from evospec.vocab.factory import static_table
    from evospec.vocab.policy import frspec_size

    tables = read_packaged(PACKAGED_ROOT / "smollm2-135m-instruct")
    assert VOCABTRIM_FILE in tables.manifest.files
    trimmed = load_counts(PACKAGED_ROOT / "smollm2-135m-instruct" / VOCABTRIM_FILE)
    assert trimmed.sum() == tables.manifest.vocabtrim["tokens"] > 400_000
    from indices.corpus import REDISTRIBUTABLE

    assert set(tables.manifest.vocabtrim["source_tokens"]) <= set(REDISTRIBUTABLE)  # like the other tables
    k = frspec_size(trimmed.size)
    ours, corpus = set(static_table(trimmed, k).tolist()), set(static_table(tables.counts, k).tolist())
    assert len(ours) == len(corpus) == k and 0.5 < len(ours & corpus) / k < 1.0  # another table, same budget


def test_the_policy_keeps_the_top_ids_at_frspecs_size() -> None:
    from evospec.vocab.config import VocabConfig
    from evospec.vocab.factory import make_policy
    from tests.vocab.helpers import stand_in_indices

    target = tiny_target(0)
    indices = stand_in_indices(target)
    policy = make_policy("vocabtrim", target.cfg.vocab_size, cfg=VocabConfig(frspec_k=10), indices=indices)
    mask = policy.active_mask(0)
    top = np.argsort(-indices.vocabtrim, kind="stable")[:10]
    assert policy.name == "vocabtrim" and int(mask.sum()) == 10 and bool(mask[torch.as_tensor(top)].all())
    indices.vocabtrim = None
    with pytest.raises(ValueError, match="vocabtrim table"):
        make_policy("vocabtrim", target.cfg.vocab_size, indices=indices)

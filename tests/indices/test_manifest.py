"""Manifest binding and verified loading: a directory loads only for the model it was built from
and only with intact files; every failure is an IndexLoadError naming the path and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from indices.build import add_hnsw, build_indices
from indices.manifest import (
    BIGRAM_FILE,
    FREQUENCY_FILE,
    HNSW_FILE,
    MANIFEST_NAME,
    IndexLoadError,
    Manifest,
    load_indices,
    model_fingerprint,
    read_manifest,
)
from tests.decoding.spec_helpers import tiny_target
from tests.indices.helpers import random_docs

VOCAB = 64


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return tiny_target(0, vocab=VOCAB).lm_head.weight.detach().clone()  # [64, 32]


@pytest.fixture
def built(tmp_path: Path, weight: torch.Tensor) -> Path:
    out = tmp_path / "idx"
    build_indices(weight, random_docs(50, VOCAB), out, model_name="tiny", progress=False, hnsw_threads=1)
    return out


def test_round_trip_loads_everything(built: Path, weight: torch.Tensor) -> None:
    bundle = load_indices(built, weight)
    m = bundle.manifest
    assert (m.model_name, m.vocab_size, m.hidden_size) == ("tiny", VOCAB, 32)
    assert set(m.files) == {FREQUENCY_FILE, BIGRAM_FILE, HNSW_FILE}
    assert bundle.counts.sum() == m.corpus.num_tokens and m.corpus.num_documents == 50
    assert bundle.graph.num_edges == m.num_edges
    assert bundle.hnsw is not None and bundle.hnsw.search(np.ones(32), 5).shape == (1, 5)
    assert Manifest.from_dict(json.loads((built / MANIFEST_NAME).read_text())) == m
    assert load_indices(built, weight, need_hnsw=False).hnsw is None


def _error(built: Path, weight: torch.Tensor, **kw) -> IndexLoadError:
    with pytest.raises(IndexLoadError) as info:
        load_indices(built, weight, **kw)
    assert "evospec-index build --model tiny" in str(info.value)  # says how to rebuild
    return info.value


def test_fingerprint_mismatch(built: Path, weight: torch.Tensor) -> None:
    other = weight.clone()
    other[0, 0] += 0.5  # row 0 is always fingerprinted
    err = _error(built, other)
    assert err.kind == "model_mismatch" and "fingerprint" in str(err) and str(built) in str(err)


def test_vocab_size_mismatch(built: Path, weight: torch.Tensor) -> None:
    err = _error(built, torch.cat([weight, weight[:1]]))
    assert err.kind == "model_mismatch" and "vocab 64" in str(err) and "65" in str(err)


@pytest.mark.parametrize("name", [FREQUENCY_FILE, BIGRAM_FILE, HNSW_FILE])
def test_flipped_byte_names_the_file(built: Path, weight: torch.Tensor, name: str) -> None:
    path = built / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    err = _error(built, weight)
    assert err.kind == "corrupt" and err.path == path and "sha256" in str(err) and name in str(err)


def test_missing_and_truncated_files(built: Path, weight: torch.Tensor) -> None:
    (built / HNSW_FILE).unlink()
    err = _error(built, weight)
    assert err.path == built / HNSW_FILE and "missing" in str(err)
    assert load_indices(built, weight, need_hnsw=False).graph is not None  # not needed, not checked
    path = built / BIGRAM_FILE
    path.write_bytes(path.read_bytes()[:-10])
    err = _error(built, weight, need_hnsw=False)
    assert err.path == path and "truncated" in str(err)


def test_missing_or_unreadable_manifest(tmp_path: Path, built: Path, weight: torch.Tensor) -> None:
    with pytest.raises(IndexLoadError, match="no such directory") as info:
        load_indices(tmp_path / "nowhere", weight)
    assert info.value.kind == "missing" and "evospec-index build" in str(info.value)
    (built / MANIFEST_NAME).write_text("{")
    with pytest.raises(IndexLoadError, match="unreadable manifest"):
        load_indices(built, weight)
    (built / MANIFEST_NAME).unlink()
    with pytest.raises(IndexLoadError, match=f"no {MANIFEST_NAME}"):
        load_indices(built, weight)


def test_without_hnsw_then_added(tmp_path: Path, weight: torch.Tensor) -> None:
    out = tmp_path / "idx"
    build_indices(weight, random_docs(20, VOCAB), out, model_name="tiny", hnsw=False, progress=False)
    assert read_manifest(out).hnsw is None and not (out / HNSW_FILE).exists()
    assert load_indices(out, weight, need_hnsw=False).hnsw is None
    assert _error(out, weight).kind == "no_hnsw"
    add_hnsw(out, weight, progress=False, hnsw_threads=1)
    assert load_indices(out, weight).hnsw is not None


def test_fingerprint_is_cheap_deterministic_and_dtype_stable(weight: torch.Tensor) -> None:
    fp = model_fingerprint(weight)
    assert fp == model_fingerprint(weight.clone()) and len(fp) == 64
    assert model_fingerprint(weight.to(torch.bfloat16)) == fp  # same checkpoint served in bf16
    assert model_fingerprint(weight[:-1]) != fp  # shape is hashed
    last = weight.clone()
    last[-1, 3] += 1.0
    assert model_fingerprint(last) != fp  # the last row is hashed
    unsampled = weight.clone()
    unsampled[1] += 1.0  # row 1 is not in the stride-61 subset: cheapness has this price
    assert model_fingerprint(unsampled) == fp

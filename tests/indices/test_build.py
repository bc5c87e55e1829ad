"""Building: one pass feeds both counters, tokenization matches the codec, the directory is
replaced atomically, and a folder that is not an index directory is never replaced."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from indices.bigram import BigramGraph, BigramParams
from indices.build import build_from_texts, build_indices, tokenize_texts
from indices.frequency import count_tokens
from indices.manifest import MANIFEST_NAME, load_indices, read_manifest
from tests.indices.helpers import CORPUS, random_docs, tiny_codec, tiny_model_for


@pytest.fixture(scope="module")
def codec():
    return tiny_codec(CORPUS.split("\n\n") * 4)


def test_tokenize_matches_codec_and_honours_max_tokens(codec) -> None:
    texts = CORPUS.split("\n\n")
    seqs = list(tokenize_texts(texts, codec, batch_size=3, progress=False))
    assert [s.tolist() for s in seqs] == [codec.encode(t) for t in texts]
    cut = list(tokenize_texts(texts, codec, max_tokens=20, progress=False))
    assert sum(s.size for s in cut) == 20 and cut[0].tolist() == seqs[0].tolist()[: cut[0].size]


def test_build_counts_match_separate_passes(tmp_path: Path) -> None:
    weight = torch.randn(40, 8)
    docs = [d.numpy() for d in random_docs(80, 40, seed=3)]
    params = BigramParams(min_count=2, min_prob=0.01, max_degree=5)
    m = build_indices(
        weight, iter(docs), tmp_path / "i", model_name="r", bigram_params=params, hnsw=False, progress=False
    )
    bundle = load_indices(tmp_path / "i", weight, need_hnsw=False)
    assert np.array_equal(bundle.counts, count_tokens(docs, 40))
    ref = BigramGraph.from_sequences(docs, 40, params)
    assert np.array_equal(bundle.graph.indices, ref.indices) and np.array_equal(
        bundle.graph.indptr, ref.indptr
    )
    assert m.corpus.num_tokens == sum(d.size for d in docs) and m.bigram == params
    assert set(m.build_seconds) >= {"tokenize_and_count", "bigram_prune", "total"}


def test_rebuild_replaces_directory_and_leaves_no_temp(tmp_path: Path, codec) -> None:
    model = tiny_model_for(codec)
    weight = model.lm_head.weight
    out = tmp_path / "idx"
    first = build_from_texts(
        weight, codec, CORPUS.split("\n\n"), out, model_name="t", progress=False, hnsw_threads=1
    )
    (out / "stale.txt").write_text("from the old build")
    second = build_from_texts(
        weight, codec, CORPUS.split("\n\n")[:1], out, model_name="t", hnsw=False, progress=False
    )
    assert second.corpus.num_tokens < first.corpus.num_tokens
    assert read_manifest(out) == second and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # no temp or old folders left


def test_refuses_to_replace_a_foreign_folder(tmp_path: Path) -> None:
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "data.txt").write_text("keep me")
    with pytest.raises(ValueError, match=f"no {MANIFEST_NAME}"):
        build_indices(torch.randn(8, 4), [[1, 2]], folder, model_name="x", hnsw=False, progress=False)
    assert (folder / "data.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    build_indices(torch.randn(8, 4), [[1, 2]], empty, model_name="x", hnsw=False, progress=False)
    assert (empty / MANIFEST_NAME).is_file()


def test_tokenizer_larger_than_head_refused(tmp_path: Path, codec) -> None:
    with pytest.raises(ValueError, match="LM head only 10 rows"):
        build_from_texts(torch.randn(10, 4), codec, ["hi"], tmp_path / "i", model_name="x", progress=False)

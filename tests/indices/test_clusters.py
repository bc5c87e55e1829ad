"""Vocabulary clusters: spherical k-means over LM-head rows, listed and verified like the other
index files; and the generic optional-file path they share with the vocabtrim table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from indices.build import build_indices
from indices.clusters import add_clusters, spherical_kmeans
from indices.manifest import CLUSTERS_FILE, IndexLoadError, add_index_file, load_indices
from tests.decoding.spec_helpers import tiny_target
from tests.indices.helpers import random_docs

VOCAB = 64


def test_rows_pointing_the_same_way_share_a_cluster_whatever_their_norm() -> None:
    gen = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(torch.randn(4, 16, generator=gen), dim=-1)  # [4, D]
    group = torch.arange(40) % 4
    scale = torch.rand(40, 1, generator=gen) * 5 + 0.1
    rows = directions[group] * scale + 1e-3 * torch.randn(40, 16, generator=gen)
    assign = spherical_kmeans(rows, 4, seed=1)
    # one cluster per direction: the assignment is the grouping up to renaming
    assert len({(int(g), int(a)) for g, a in zip(group, assign, strict=True)}) == 4
    assert np.array_equal(assign, spherical_kmeans(rows, 4, seed=1))  # deterministic for a seed


def test_every_cluster_holds_an_id_and_bad_k_is_refused() -> None:
    weight = tiny_target(0, vocab=VOCAB).lm_head.weight
    assign = spherical_kmeans(weight, 16)
    assert assign.shape == (VOCAB,) and set(assign.tolist()) == set(range(16))
    for k in (0, VOCAB + 1):
        with pytest.raises(ValueError, match="k must be in"):
            spherical_kmeans(weight, k)


def test_the_clusters_are_listed_verified_and_loaded(tmp_path: Path) -> None:
    weight = tiny_target(0, vocab=VOCAB).lm_head.weight.detach().clone()
    out = tmp_path / "idx"
    build_indices(weight, random_docs(30, VOCAB), out, model_name="tiny", progress=False, hnsw_threads=1)
    assert load_indices(out, weight, need_hnsw=False).clusters is None  # optional
    m = add_clusters(out, weight, 8, command="evospec-index clusters --k 8")
    rec = m.extras[CLUSTERS_FILE]
    assert CLUSTERS_FILE in m.files and rec["clusters"] == 8 and rec["command"].endswith("--k 8")
    bundle = load_indices(out, weight, need_hnsw=False)
    assert np.array_equal(bundle.clusters, spherical_kmeans(weight, 8))
    assert bundle.manifest.extras == m.extras  # the record survives the JSON round trip
    (out / CLUSTERS_FILE).write_bytes((out / CLUSTERS_FILE).read_bytes()[:-4])  # truncated
    with pytest.raises(IndexLoadError, match=CLUSTERS_FILE):
        load_indices(out, weight, need_hnsw=False)
    with pytest.raises(ValueError, match="not an optional index file"):
        add_index_file(out, weight, "frequency.npy", lambda p: None, {})
    other = tiny_target(5, vocab=VOCAB).lm_head.weight
    with pytest.raises(IndexLoadError, match="another model"):
        add_clusters(out, other, 8)

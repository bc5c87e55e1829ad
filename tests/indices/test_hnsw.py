"""HNSW over LM-head rows: norm augmentation turns MIPS into L2 search exactly; on the real default
model the index reaches recall@10 >= 0.95 at the default ef against exact inner-product top-10,
with real final hidden states as queries, and returns ids in inner-product order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from evospec.models.loading import LoadedModel
from indices.hnsw import (
    DEFAULT_EF,
    HnswParams,
    LMHeadIndex,
    augment_items,
    augment_queries,
    exact_top_k,
    recall_at_k,
)

PROMPTS = (
    "The three primary colours are",
    "Write a Python function that checks whether a number is prime.",
    "Explain in plain words what an indemnification clause in a contract does.",
    "Translate German to English: Der Hund schläft unter dem Tisch.",
)
CI_ROWS = 4096


def test_augmented_l2_order_is_inner_product_order() -> None:
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.2, 3.0, size=(300, 1))  # rows of very different norms
    w = (rng.normal(size=(300, 16)) * scale).astype(np.float32)
    h = rng.normal(size=(20, 16)).astype(np.float32) * 5
    x, max_norm = augment_items(w)
    assert np.allclose(np.linalg.norm(x, axis=1), max_norm, rtol=1e-5)  # every item on one sphere
    d2 = ((augment_queries(h)[:, None, :] - x[None]) ** 2).sum(-1)  # [20, 300]
    assert np.array_equal(np.argsort(d2, axis=1, kind="stable")[:, :10], exact_top_k(w, h, 10))
    centred = w - w.mean(0)  # the build centres rows: the same top-k for every query
    assert np.array_equal(exact_top_k(centred, h, 10), exact_top_k(w, h, 10))


def test_search_api_and_save_load(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.normal(size=(500, 8)).astype(np.float32)
    index, _ = LMHeadIndex.build(w, HnswParams(m=8, ef_construction=50, ef=64), num_threads=1, progress=False)
    h = rng.normal(size=(6, 8)).astype(np.float32)
    found = index.search(h, 10)
    assert found.shape == (6, 10) and found.dtype == np.int64
    assert recall_at_k(found, exact_top_k(w, h, 10)) >= 0.95  # a small in-distribution set
    assert np.array_equal(index.search(h[0], 10), found[:1])  # a single [D] query gives [1, k]
    assert index.search(h, 200).shape == (6, 200) and index.ef == 64  # k > ef: searched with k
    index.save(tmp_path / "h.bin")
    loaded = LMHeadIndex.load(tmp_path / "h.bin", 8, ef=64)
    assert loaded.num_items == 500 and np.array_equal(loaded.search(h, 10), found)
    with pytest.raises(ValueError, match="hidden size"):
        index.search(np.zeros(7), 3)
    with pytest.raises(ValueError, match="k must be"):
        index.search(h, 0)


def final_hidden(loaded: LoadedModel) -> np.ndarray:
    """[n, D] final-norm hidden states of every position of a few short prompts (plain + chat)."""
    model, codec = loaded.model, loaded.codec
    rows = []
    for prompt in PROMPTS:
        for ids in (codec.encode(prompt), codec.encode_chat([{"role": "user", "content": prompt}])):
            cache = model.new_cache(len(ids))
            out = model(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="none")
            rows.append(out.hidden[0].float().numpy())
    return np.unique(np.concatenate(rows), axis=0)  # chat prompts share their first positions


def check_recall_and_order(w: np.ndarray, h: np.ndarray, index: LMHeadIndex) -> float:
    found = index.search(h, 10)  # [n, 10]
    recall = recall_at_k(found, exact_top_k(w, h, 10))
    scores = np.take_along_axis(h @ w.T, found, axis=1)  # [n, 10] inner products of the answers
    assert np.all(np.diff(scores, axis=1) <= 1e-3 * np.abs(scores).max()), "not in inner-product order"
    return recall


def test_recall_on_real_lm_head_rows_ci(default_model: LoadedModel) -> None:
    """A seeded 4,096-row subsample of SmolLM2's LM head at the paper's M=32, ef_construction=200."""
    w_full = default_model.model.lm_head.weight.detach().float().numpy()
    rows = np.sort(np.random.default_rng(0).choice(w_full.shape[0], CI_ROWS, replace=False))
    w = w_full[rows]
    index, _ = LMHeadIndex.build(w, HnswParams(), num_threads=1, progress=False)
    h = final_hidden(default_model)
    assert h.shape[0] >= 100
    recall = check_recall_and_order(w, h, index)
    assert recall >= 0.95, f"recall@10 {recall:.3f} at ef={DEFAULT_EF}"
    index.ef = 128  # the centred, norm-ordered build needs half the beam here (plain: ~0.88)
    assert check_recall_and_order(w, h, index) >= 0.95


@pytest.mark.slow
def test_recall_on_all_lm_head_rows(default_model: LoadedModel) -> None:
    """All 49,152 rows (about a minute on several cores, a few on one)."""
    w = default_model.model.lm_head.weight.detach().float().numpy()
    index, _ = LMHeadIndex.build(w, HnswParams(), num_threads=-1, progress=False)
    recall = check_recall_and_order(w, final_hidden(default_model), index)
    assert recall >= 0.95, f"recall@10 {recall:.3f} at ef={DEFAULT_EF}"

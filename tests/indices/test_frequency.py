"""Token-frequency table: counts, chunked accumulation, deterministic top-k, save/load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from indices.frequency import TokenCounter, count_tokens, load_counts, save_counts, top_ids


def test_counts_exact() -> None:
    counts = count_tokens([[0, 1, 1], [], [3, 1], np.array([0])], vocab_size=5)
    assert counts.tolist() == [2, 3, 0, 1, 0] and counts.dtype == np.int64


def test_chunked_counter_matches_one_bincount() -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 100, size=rng.integers(0, 20)) for _ in range(300)]
    counter = TokenCounter(100, chunk_tokens=7)
    for s in seqs:
        counter.add(s)
    assert np.array_equal(counter.counts, np.bincount(np.concatenate(seqs), minlength=100))
    assert counter.num_tokens == sum(s.size for s in seqs)
    assert counter.num_sequences == sum(1 for s in seqs if s.size)


def test_top_ids_ties_go_to_lower_id() -> None:
    counts = np.array([3, 5, 5, 0, 3, 5])
    assert top_ids(counts, 4).tolist() == [1, 2, 5, 0]
    assert top_ids(counts, 100).tolist() == [1, 2, 5, 0, 4, 3]
    assert top_ids(np.zeros(4, dtype=np.int64), 2).tolist() == [0, 1]
    assert top_ids(counts, 2).dtype == np.int64


def test_save_load(tmp_path: Path) -> None:
    counts = np.arange(10, dtype=np.int64)
    save_counts(tmp_path / "f.npy", counts)
    assert np.array_equal(load_counts(tmp_path / "f.npy"), counts)
    np.save(tmp_path / "bad.npy", np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"bad\.npy"):
        load_counts(tmp_path / "bad.npy")


def test_out_of_range_refused() -> None:
    with pytest.raises(ValueError, match=r"out of range \[0, 3\)"):
        count_tokens([[0, 3]], vocab_size=3)

"""Token-frequency table: how often each token id occurs in a corpus.

Owns: counting ids in a stream of token-id sequences (buffered ``np.bincount``, so a corpus of
many short documents costs O(tokens + V * chunks), not O(V) per document), saving and loading
the [V] int64 table (.npy), and the deterministic top-k (ties go to the lower id) that a static
frequency vocabulary (FR-Spec style) is cut from.

Does not know about text, tokenizers or models.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

CHUNK_TOKENS = 1 << 22  # ids buffered before one bincount


class TokenCounter:
    """Accumulates token counts over sequences: ``add`` each, then read ``counts``."""

    def __init__(self, vocab_size: int, chunk_tokens: int = CHUNK_TOKENS) -> None:
        self.vocab_size = vocab_size
        self.chunk_tokens = chunk_tokens
        self._counts = np.zeros(vocab_size, dtype=np.int64)  # [V]
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self.num_tokens = 0
        self.num_sequences = 0

    def add(self, ids: np.ndarray) -> None:
        """Count one sequence of ids (``ids`` [n] int, each in [0, V))."""
        ids = np.asarray(ids)
        if ids.size == 0:
            return
        check_ids(ids, self.vocab_size)
        self._pending.append(ids)
        self._pending_tokens += ids.size
        self.num_tokens += ids.size
        self.num_sequences += 1
        if self._pending_tokens >= self.chunk_tokens:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            ids = np.concatenate(self._pending)
            self._counts += np.bincount(ids, minlength=self.vocab_size)
            self._pending, self._pending_tokens = [], 0

    @property
    def counts(self) -> np.ndarray:
        """[V] int64: occurrences of each id so far."""
        self._flush()
        return self._counts


def check_ids(ids: np.ndarray, vocab_size: int) -> None:
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token id out of range [0, {vocab_size}): min {ids.min()}, max {ids.max()}")


def count_tokens(seqs: Iterable[Iterable[int] | np.ndarray], vocab_size: int) -> np.ndarray:
    """[V] int64 occurrences of each id over all sequences."""
    counter = TokenCounter(vocab_size)
    for seq in seqs:
        counter.add(np.asarray(seq, dtype=np.int64))
    return counter.counts


def top_ids(counts: np.ndarray, k: int) -> np.ndarray:
    """[min(k, V)] int64: the ids of the k largest counts, largest first; ties go to the lower id."""
    order = np.argsort(-np.asarray(counts, dtype=np.int64), kind="stable")  # stable: lower id first
    return order[:k].astype(np.int64)


def save_counts(path: Path, counts: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, np.asarray(counts, dtype=np.int64), allow_pickle=False)


def load_counts(path: Path) -> np.ndarray:
    counts = np.load(path, allow_pickle=False)
    if counts.ndim != 1 or counts.dtype != np.int64:
        raise ValueError(f"{path}: expected a 1-D int64 count table, got {counts.dtype} {counts.shape}")
    return counts

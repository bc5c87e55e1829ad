"""Sparse bigram successor graph: for each token u, the tokens v that most often follow it.

Owns: counting adjacent pairs (u, v) *within* each sequence (never across two sequences),
streamed in chunks of int64 pair keys ``u * V + v`` reduced to sparse CSR counts, so memory
grows with the number of distinct pairs, never with V^2; pruning to the graph of the paper's
Appendix C (count >= min_count, p(v|u) = count(u, v) / count(u, .) >= min_prob, at most
max_degree successors per u); successor look-ups; saving (compressed, byte-for-byte
reproducible) and loading (.npz).

Rows are stored sorted by descending p(v|u); equal p goes to the lower id. The denominator
count(u, .) counts every pair that starts with u, pruned or not.

Does not know about text, tokenizers or models.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from indices.frequency import check_ids

CHUNK_PAIRS = 1 << 22  # pair keys buffered before they are reduced into the sparse counts
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # member timestamp of a saved graph (the zip format's earliest)


@dataclass(frozen=True)
class BigramParams:
    min_count: int = 5  # an edge needs at least this many occurrences of (u, v)
    min_prob: float = 1e-4  # ... and p(v|u) at least this
    max_degree: int = 64  # successors kept per u, most probable first


class PairCounter:
    """Accumulates within-sequence pair counts: ``add`` each sequence, then read ``counts``."""

    def __init__(self, vocab_size: int, chunk_pairs: int = CHUNK_PAIRS) -> None:
        self.vocab_size = vocab_size
        self.chunk_pairs = chunk_pairs
        self._counts = sp.csr_matrix((vocab_size, vocab_size), dtype=np.int64)  # [V, V]
        self._pending: list[np.ndarray] = []
        self._pending_pairs = 0

    def add(self, ids: np.ndarray) -> None:
        """Count the adjacent pairs of one sequence (``ids`` [n] int, each in [0, V))."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size < 2:
            return
        check_ids(ids, self.vocab_size)
        keys = ids[:-1] * self.vocab_size + ids[1:]  # [n - 1]
        self._pending.append(keys)
        self._pending_pairs += keys.size
        if self._pending_pairs >= self.chunk_pairs:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        keys, n = np.unique(np.concatenate(self._pending), return_counts=True)
        rows, cols = np.divmod(keys, self.vocab_size)
        chunk = sp.csr_matrix((n.astype(np.int64), (rows, cols)), shape=self._counts.shape)
        self._counts = self._counts + chunk
        self._pending, self._pending_pairs = [], 0

    @property
    def counts(self) -> sp.csr_matrix:
        """[V, V] int64 CSR: count(u, v) of pairs seen so far."""
        self._flush()
        return self._counts


class BigramGraph:
    """Pruned successor lists in CSR form, each row sorted by descending p(v|u)."""

    def __init__(
        self,
        indptr: np.ndarray,  # [V + 1] int64
        indices: np.ndarray,  # [E] int32 successor ids
        data: np.ndarray,  # [E] float32 p(v|u)
        params: BigramParams,
    ) -> None:
        if indptr.ndim != 1 or indptr[0] != 0 or indptr[-1] != indices.size or indices.size != data.size:
            raise ValueError("inconsistent CSR arrays for a bigram graph")
        self.indptr = indptr.astype(np.int64, copy=False)
        self.indices = indices.astype(np.int32, copy=False)
        self.data = data.astype(np.float32, copy=False)
        self.params = params

    @property
    def vocab_size(self) -> int:
        return self.indptr.size - 1

    @property
    def num_edges(self) -> int:
        return int(self.indices.size)

    @classmethod
    def from_counts(cls, counts: sp.csr_matrix, params: BigramParams = BigramParams()) -> BigramGraph:
        """Prune raw pair counts ([V, V] sparse) into the successor graph."""
        coo = sp.coo_matrix(counts)
        coo.sum_duplicates()
        vocab = coo.shape[0]
        rows, cols, n = coo.row.astype(np.int64), coo.col.astype(np.int64), coo.data.astype(np.int64)
        totals = np.bincount(rows, weights=n, minlength=vocab)  # [V] count(u, .) before pruning
        prob = n / np.maximum(totals[rows], 1)  # [nnz] float64
        keep = (n >= params.min_count) & (prob >= params.min_prob)
        rows, cols, n, prob = rows[keep], cols[keep], n[keep], prob[keep]
        # Within a row p is count / same total, so sorting by count is sorting by p, exactly.
        order = np.lexsort((cols, -n, rows))  # row, then count desc, then id asc
        rows, cols, prob = rows[order], cols[order], prob[order]
        starts = np.searchsorted(rows, rows, side="left")  # first edge of each edge's row
        rank = np.arange(rows.size) - starts
        keep = rank < params.max_degree
        rows, cols, prob = rows[keep], cols[keep], prob[keep]
        indptr = np.zeros(vocab + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=vocab), out=indptr[1:])
        return cls(indptr, cols.astype(np.int32), prob.astype(np.float32), params)

    @classmethod
    def from_sequences(
        cls,
        seqs: Iterable[Iterable[int] | np.ndarray],
        vocab_size: int,
        params: BigramParams = BigramParams(),
    ) -> BigramGraph:
        counter = PairCounter(vocab_size)
        for seq in seqs:
            counter.add(np.asarray(seq, dtype=np.int64))
        return cls.from_counts(counter.counts, params)

    def degree(self, u: int) -> int:
        return int(self.indptr[u + 1] - self.indptr[u])

    def successors(self, u: int, k: int) -> np.ndarray:
        """[<= k] int64: the k most probable successors of ``u``, most probable first."""
        start = self.indptr[u]
        end = min(self.indptr[u + 1], start + max(k, 0))
        return self.indices[start:end].astype(np.int64)

    def probs(self, u: int) -> np.ndarray:
        """[degree(u)] float32: p(v|u) of the stored successors, in successor order."""
        return self.data[self.indptr[u] : self.indptr[u + 1]].copy()

    def successors_many(self, ids: Iterable[int] | np.ndarray, k: int) -> np.ndarray:
        """[sum of min(k, degree)] int64: successors of each seed, concatenated in seed order
        (not deduplicated)."""
        seeds = np.asarray(ids, dtype=np.int64).reshape(-1)  # [S]
        starts = self.indptr[seeds]  # [S]
        lens = np.minimum(self.indptr[seeds + 1] - starts, max(k, 0))  # [S]
        total = int(lens.sum())
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        offsets = np.repeat(starts - np.cumsum(lens) + lens, lens)  # [total] start minus out pos
        return self.indices[offsets + np.arange(total)].astype(np.int64)

    def save(self, path: Path) -> None:
        """A compressed .npz (what ``np.load`` reads) with fixed member timestamps, so one graph
        always gives the same bytes (and checksum)."""
        p = self.params
        arrays = {
            "indptr": self.indptr,
            "indices": self.indices,
            "data": self.data,
            "min_count": np.int64(p.min_count),
            "min_prob": np.float64(p.min_prob),
            "max_degree": np.int64(p.max_degree),
        }
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
            for name, value in arrays.items():
                info = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_EPOCH)
                info.compress_type = zipfile.ZIP_DEFLATED
                with z.open(info, "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asanyarray(value), allow_pickle=False)

    @classmethod
    def load(cls, path: Path) -> BigramGraph:
        with np.load(path, allow_pickle=False) as z:
            params = BigramParams(int(z["min_count"]), float(z["min_prob"]), int(z["max_degree"]))
            return cls(z["indptr"], z["indices"], z["data"], params)

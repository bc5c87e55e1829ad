"""Small vocabulary settings and stand-in indices for tests on tiny random targets."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from evospec.vocab.factory import VocabConfig

# Sized for a 64-id vocabulary: every policy really misses tokens, the ARC really evicts.
SMALL = VocabConfig(
    frspec_k=16,
    w_max=24,
    arc_capacity=8,
    arc_ghost=8,
    arc_p_init=4,
    arc_max_insert=4,
    arc_min_residency=2,
    arc_warmup=3,
    n_top=3,
    n_sem=3,
    per_seed=2,
    synchronous=True,  # retrieval inline: deterministic ARC contents
)


class ExactSearch:
    """Brute-force inner-product search standing in for the HNSW index."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.w = weight.detach().float().numpy()  # [V, D]

    def search(self, h: np.ndarray, k: int) -> np.ndarray:
        return np.argsort(-(h @ self.w.T), axis=-1, kind="stable")[:, :k]


class SuccGraph:
    """A deterministic successor graph: u -> (7u + j) mod V."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def successors(self, u: int, k: int) -> np.ndarray:
        return np.array([(u * 7 + j) % self.vocab for j in range(1, k + 1)], dtype=np.int64)


def stand_in_indices(target, counts: np.ndarray | None = None) -> SimpleNamespace:
    """What ``make_decoder`` needs of an index bundle: counts (id 0 most frequent), the vocabtrim
    counts, hnsw, graph."""
    vocab = target.cfg.vocab_size
    counts = counts if counts is not None else np.arange(vocab, dtype=np.int64)[::-1].copy()
    trimmed = np.roll(counts, vocab // 3)  # the target's own counts: another order than the corpus's
    return SimpleNamespace(
        counts=counts, vocabtrim=trimmed, hnsw=ExactSearch(target.lm_head.weight), graph=SuccGraph(vocab)
    )

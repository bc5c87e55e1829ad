"""Small vocabulary settings and stand-in indices for tests on tiny random targets."""

from __future__ import annotations

import tempfile
from pathlib import Path
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
    cluster_budget=16,
    candidates=12,
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


def trained_file(save, **kw):
    """What an index bundle holds of a file ``save(path, **kw)`` writes (read back from disk)."""
    from indices.manifest import load_optional_file

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save(path=path, **kw)
        return load_optional_file(path)


def stand_in_indices(target, counts: np.ndarray | None = None) -> SimpleNamespace:
    """What ``make_decoder`` needs of an index bundle: counts (id 0 most frequent), the vocabtrim
    counts, hnsw, graph, 8 vocabulary clusters with a random router over them, an SVD selector,
    and the manifest facts those are checked against."""
    from evospec.vocab.router import ClusterRouter, save_router
    from evospec.vocab.selector import save_selector, svd_selector
    from indices.clusters import spherical_kmeans
    from indices.manifest import model_fingerprint

    weight = target.lm_head.weight
    vocab, dim = weight.shape
    counts = counts if counts is not None else np.arange(vocab, dtype=np.int64)[::-1].copy()
    trimmed = np.roll(counts, vocab // 3)  # the target's own counts: another order than the corpus's
    fingerprint = model_fingerprint(weight)
    clusters = spherical_kmeans(weight, 8, iterations=10)
    torch.manual_seed(0)
    router = trained_file(
        lambda path, **kw: save_router(ClusterRouter(dim, 8, 16), path, **kw),
        clusters=clusters,
        fingerprint=fingerprint,
    )
    selector = trained_file(
        lambda path, **kw: save_selector(svd_selector(weight, 4), path, **kw), fingerprint=fingerprint
    )
    return SimpleNamespace(
        counts=counts,
        vocabtrim=trimmed,
        hnsw=ExactSearch(weight),
        graph=SuccGraph(vocab),
        clusters=clusters,
        dynaspec=router,
        specvocab=selector,
        manifest=SimpleNamespace(model_fingerprint=fingerprint, hidden_size=dim),
    )

"""Vocabulary clusters for DynaSpec: spherical k-means over the LM-head rows.

Owns: :func:`spherical_kmeans` (unit-normalised rows, cosine assignment, centroids renormalised
every iteration, deterministic for a seed) and :func:`add_clusters`, which writes the
assignment as ``clusters.npy`` ([V] int16, the cluster of every id) into an index directory
(the ``evospec-index clusters`` command). DynaSpec (Zhang et al. 2025) routes each round to a
few of these clusters; NanoSpec's re-implementation uses 256 (papers/nanospec.txt, §4), the
default here. Ids whose rows point the same way -- the ones an LM head scores alike -- share a
cluster, so a router that picks clusters picks groups of ids that are likely together.

Empty clusters are re-seeded with the rows farthest from their centroid, so every cluster
holds at least one id. Knows nothing about the router (``evospec/vocab/router.py``).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import torch

from indices.manifest import CLUSTERS_FILE, Manifest, add_index_file

DEFAULT_CLUSTERS = 256
DEFAULT_ITERATIONS = 25


def spherical_kmeans(
    weight: torch.Tensor, k: int = DEFAULT_CLUSTERS, *, iterations: int = DEFAULT_ITERATIONS, seed: int = 0
) -> np.ndarray:
    """[V] int64 cluster of each row of ``weight`` ([V, D]) among ``k`` spherical clusters."""
    rows = torch.nn.functional.normalize(weight.detach().float().cpu(), dim=-1)  # [V, D]
    vocab = rows.shape[0]
    if not 1 <= k <= vocab:
        raise ValueError(f"clusters: k must be in [1, {vocab}] (the vocabulary), got {k}")
    gen = torch.Generator().manual_seed(seed)
    centroids = rows[torch.randperm(vocab, generator=gen)[:k]].clone()  # [k, D]
    assign = torch.zeros(vocab, dtype=torch.long)
    for _ in range(iterations):
        sim = rows @ centroids.T  # [V, k]
        best, assign = sim.max(dim=-1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, rows)  # [k, D]
        sizes = torch.bincount(assign, minlength=k)  # [k]
        empty = torch.nonzero(sizes == 0).flatten()
        if empty.numel():  # re-seed with the worst-fitting rows
            far = torch.topk(-best, empty.numel()).indices
            sums[empty] = rows[far]
            assign[far] = empty
        centroids = torch.nn.functional.normalize(sums, dim=-1)
    return assign.numpy().astype(np.int64)


def add_clusters(
    directory: Path,
    lm_head_weight: torch.Tensor,
    k: int = DEFAULT_CLUSTERS,
    *,
    iterations: int = DEFAULT_ITERATIONS,
    seed: int = 0,
    command: str = "",
) -> Manifest:
    """Cluster the LM-head rows and add ``clusters.npy`` to an index directory built for this model."""
    t0 = time.perf_counter()
    assign = spherical_kmeans(lm_head_weight, k, iterations=iterations, seed=seed)
    sizes = np.bincount(assign, minlength=k)
    buf = io.BytesIO()
    np.save(buf, assign.astype(np.int16 if k <= 32767 else np.int32), allow_pickle=False)
    record = {
        "clusters": k,
        "iterations": iterations,
        "seed": seed,
        "smallest": int(sizes.min()),
        "largest": int(sizes.max()),
        "command": command or f"evospec-index clusters --k {k}",
    }
    return add_index_file(
        directory,
        lm_head_weight,
        CLUSTERS_FILE,
        lambda tmp: Path(tmp).write_bytes(buf.getvalue()),
        record,
        seconds=time.perf_counter() - t0,
    )

"""Vocabulary policies by name, with their hyper-parameters in one typed config.

Owns: :data:`POLICIES` and what each reads, and :func:`make_policy`; the settings,
:class:`VocabConfig` (defaults = the papers' settings), live in ``config.py``.
Index files (frequency table, vocabtrim table, HNSW, bigram graph) come in as an already loaded bundle from
``indices/``; this module never reads files.
"""

from __future__ import annotations

import numpy as np

from evospec.vocab.config import VocabConfig
from evospec.vocab.policy import (
    EvoSpecVocab,
    NanoSpecEvoVocab,
    NanoSpecVocab,
    StaticVocab,
    VocabPolicy,
    frspec_size,
)
from evospec.vocab.retrieval import IndexRetriever, RetrievalPool

POLICIES = ("frspec", "nanospec", "evospec", "nanospec+evospec", "vocabtrim")
NEEDS_COUNTS = frozenset({"frspec", "evospec"})  # policies that read the frequency table
NEEDS_VOCABTRIM = frozenset({"vocabtrim"})  # ... the target's own token counts (indices/vocabtrim.py)
NEEDS_RETRIEVAL = frozenset({"evospec", "nanospec+evospec"})  # ... and the HNSW index + graph
HAS_ARC = frozenset({"evospec", "nanospec+evospec"})  # policies that keep an ARC buffer


def static_table(counts: np.ndarray, k: int) -> np.ndarray:
    """The top-``k`` ids by corpus count (ties: lower id first)."""
    order = np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.int64)))
    return np.sort(order[:k])


def make_policy(
    name: str, vocab_size: int, *, cfg: VocabConfig | None = None, indices=None, device="cpu"
) -> VocabPolicy:
    """A fresh policy. ``indices``: an ``indices.IndexBundle`` (counts, graph, hnsw) when needed."""
    cfg = cfg or VocabConfig()
    if name not in POLICIES:
        raise ValueError(f"unknown vocabulary policy {name!r}; available: {', '.join(POLICIES)}")
    if (name in NEEDS_COUNTS or name in NEEDS_RETRIEVAL or name in NEEDS_VOCABTRIM) and indices is None:
        raise ValueError(f"policy {name!r} needs the model's indices (build them with evospec-index build)")
    k = min(vocab_size, cfg.frspec_k or frspec_size(vocab_size))
    if name == "frspec":
        return StaticVocab(static_table(indices.counts, k), vocab_size, device)
    if name == "vocabtrim":  # FR-Spec's size rule over the target's own token counts
        trimmed = getattr(indices, "vocabtrim", None)
        if trimmed is None:
            raise ValueError("policy vocabtrim needs the indices' vocabtrim table (evospec-index vocabtrim)")
        return StaticVocab(static_table(trimmed, k), vocab_size, device, name="vocabtrim")
    if name == "nanospec":
        return NanoSpecVocab(vocab_size, cfg.nano, device)
    retriever = IndexRetriever(indices.hnsw, indices.graph, n_sem=cfg.n_sem, per_seed=cfg.per_seed)
    pool = RetrievalPool(retriever, max_pending=cfg.max_pending, synchronous=cfg.synchronous)
    if name == "evospec":
        core = static_table(indices.counts, min(vocab_size, cfg.core_k or k))
        return EvoSpecVocab(
            core, vocab_size, pool, arc=cfg.arc, top_n=cfg.n_top, persist=cfg.persist, device=device
        )
    return NanoSpecEvoVocab(
        vocab_size, pool, nano=cfg.nano, arc=cfg.arc, top_n=cfg.n_top, persist=cfg.persist, device=device
    )

"""Vocabulary policies by name, with their hyper-parameters in one typed config.

Owns: :data:`POLICIES`, :class:`VocabConfig` (defaults = the papers' settings, see
``papers/nanospec.txt`` §4 and ``papers/evospec.txt`` Table 7) and :func:`make_policy`.
Index files (frequency table, HNSW, bigram graph) come in as an already loaded bundle from
``indices/``; this module never reads files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evospec.vocab.arc import ARCConfig
from evospec.vocab.policy import (
    EvoSpecVocab,
    NanoSpecConfig,
    NanoSpecEvoVocab,
    NanoSpecVocab,
    StaticVocab,
    VocabPolicy,
    frspec_size,
)
from evospec.vocab.retrieval import IndexRetriever, RetrievalPool

POLICIES = ("frspec", "nanospec", "evospec", "nanospec+evospec")
NEEDS_COUNTS = frozenset({"frspec", "evospec"})  # policies that read the frequency table
NEEDS_RETRIEVAL = frozenset({"evospec", "nanospec+evospec"})  # ... and the HNSW index + graph
HAS_ARC = frozenset({"evospec", "nanospec+evospec"})  # policies that keep an ARC buffer
SHARED_BUDGET = frozenset({"nanospec+evospec"})  # window and ARC buffer share w_max


@dataclass(frozen=True)
class VocabConfig:
    frspec_k: int | None = None  # static table size (FR-Spec, EvoSpec core); None: frspec_size(V)
    core_k: int | None = None  # EvoSpec's static core alone; None: the same size as frspec_k
    k_pre: int = 3  # NanoSpec: top ids per prompt position at prefill
    k_ver: int = 3  # NanoSpec: top ids per verified-path node per round
    w_max: int = 3072  # NanoSpec window; also the nanospec+evospec budget
    arc_capacity: int = 256  # EvoSpec dynamic buffer
    arc_ghost: int = 256  # |B1|, |B2|
    arc_p_init: int = 128
    arc_max_insert: int = 32  # insertions per OOV event
    arc_min_residency: int = 8  # rounds before an entry may be evicted
    arc_warmup: int = 50  # events with p frozen
    n_top: int = 10  # target top ids at the rejected position
    n_sem: int = 10  # HNSW neighbours of the target hidden state there
    per_seed: int = 8  # bigram successors per seed
    max_pending: int = 4  # in-flight retrievals before new OOV events are dropped
    synchronous: bool = False  # run retrieval inline (deterministic; for tests and ablations)
    persist: bool = True  # keep the ARC buffer across requests (False: reset per request)

    def budget_problem(self, policy: str) -> str | None:
        """Why these settings cannot run ``policy`` (None: they can): the policies in
        :data:`SHARED_BUDGET` split ``w_max`` between the window and the ARC buffer."""
        if policy in SHARED_BUDGET and self.w_max <= self.arc_capacity:
            return (
                f"{policy} shares vocab.w_max ({self.w_max}) between the window and the ARC buffer: "
                f"it must exceed vocab.arc_capacity ({self.arc_capacity})"
            )
        return None

    def __post_init__(self) -> None:
        for name in ("k_pre", "k_ver", "w_max", "arc_capacity", "n_top", "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"vocab.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("frspec_k", "core_k"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"vocab.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def arc(self) -> ARCConfig:
        return ARCConfig(
            capacity=self.arc_capacity,
            ghost_capacity=self.arc_ghost,
            p_init=self.arc_p_init,
            max_insert=self.arc_max_insert,
            min_residency=self.arc_min_residency,
            warmup_events=self.arc_warmup,
        )

    @property
    def nano(self) -> NanoSpecConfig:
        return NanoSpecConfig(k_pre=self.k_pre, k_ver=self.k_ver, w_max=self.w_max)


def static_table(counts: np.ndarray, k: int) -> np.ndarray:
    """The top-``k`` ids by corpus count (ties: lower id first)."""
    order = np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.int64)))
    return np.sort(order[:k])


def make_policy(
    name: str, vocab_size: int, *, cfg: VocabConfig = VocabConfig(), indices=None, device="cpu"
) -> VocabPolicy:
    """A fresh policy. ``indices``: an ``indices.IndexBundle`` (counts, graph, hnsw) when needed."""
    if name not in POLICIES:
        raise ValueError(f"unknown vocabulary policy {name!r}; available: {', '.join(POLICIES)}")
    if (name in NEEDS_COUNTS or name in NEEDS_RETRIEVAL) and indices is None:
        raise ValueError(f"policy {name!r} needs the model's indices (build them with evospec-index build)")
    k = min(vocab_size, cfg.frspec_k or frspec_size(vocab_size))
    if name == "frspec":
        return StaticVocab(static_table(indices.counts, k), vocab_size, device)
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

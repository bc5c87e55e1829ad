"""Vocabulary policies by name, with their hyper-parameters in one typed config.

Owns: :data:`POLICIES` and what each reads, and :func:`make_policy`; the settings,
:class:`VocabConfig` (defaults = the papers' settings), live in ``config.py``.
Index files (frequency table, vocabtrim table, HNSW, bigram graph, vocabulary clusters, the
DynaSpec router, the SpecVocab selector) come in as an already loaded bundle from ``indices/``;
this module never reads files.
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

POLICIES = ("frspec", "nanospec", "evospec", "nanospec+evospec", "vocabtrim", "dynaspec", "specvocab")
NEEDS_COUNTS = frozenset({"frspec", "evospec"})  # policies that read the frequency table
# ... the indices' optional files a policy reads (indices/manifest.py: OPTIONAL_FILES)
NEEDS_FILES: dict[str, tuple[str, ...]] = {
    "vocabtrim": ("vocabtrim.npy",),  # the target's own token counts (indices/vocabtrim.py)
    "dynaspec": ("clusters.npy", "dynaspec.safetensors"),  # clusters + router (vocab/router.py)
    "specvocab": ("specvocab.safetensors",),  # the low-rank selector (vocab/selector.py)
}
NEEDS_RETRIEVAL = frozenset({"evospec", "nanospec+evospec"})  # ... and the HNSW index + graph
HAS_ARC = frozenset({"evospec", "nanospec+evospec"})  # policies that keep an ARC buffer


def static_table(counts: np.ndarray, k: int) -> np.ndarray:
    """The top-``k`` ids by corpus count (ties: lower id first)."""
    order = np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.int64)))
    return np.sort(order[:k])


def make_policy(
    name: str, vocab_size: int, *, cfg: VocabConfig | None = None, indices=None, device="cpu"
) -> VocabPolicy:
    """A fresh policy. ``indices``: an ``indices.IndexBundle`` (counts, graph, hnsw, the optional
    files) when needed."""
    cfg = cfg or VocabConfig()
    if name not in POLICIES:
        raise ValueError(f"unknown vocabulary policy {name!r}; available: {', '.join(POLICIES)}")
    if (name in NEEDS_COUNTS or name in NEEDS_RETRIEVAL or name in NEEDS_FILES) and indices is None:
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
    if name in ("dynaspec", "specvocab"):
        return _trained_policy(name, vocab_size, cfg, indices, device)
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


def _trained_policy(name: str, vocab_size: int, cfg: VocabConfig, indices, device) -> VocabPolicy:
    """dynaspec / specvocab: the policy around the router or selector the indices hold (made
    for the model the indices' manifest was checked against: its LM-head fingerprint)."""
    trained = getattr(indices, name, None)
    if trained is None:
        raise ValueError(
            f"policy {name} needs the indices' {NEEDS_FILES[name][-1]} (train it: evospec train-vocab {name})"
        )
    fingerprint = indices.manifest.model_fingerprint
    if name == "dynaspec":
        from evospec.vocab.routed import DynaSpecVocab
        from evospec.vocab.router import load_router

        clusters = getattr(indices, "clusters", None)
        if clusters is None:
            raise ValueError("policy dynaspec needs the indices' clusters.npy (evospec-index clusters)")
        router = load_router(trained, clusters=clusters, fingerprint=fingerprint, device=device)
        return DynaSpecVocab(clusters, router, cfg.cluster_budget, device)
    from evospec.vocab.routed import SpecVocabPolicy
    from evospec.vocab.selector import load_selector

    selector = load_selector(
        trained,
        vocab_size=vocab_size,
        dim=indices.manifest.hidden_size,
        fingerprint=fingerprint,
        device=device,
    )
    return SpecVocabPolicy(selector, vocab_size, min(cfg.candidates, vocab_size))

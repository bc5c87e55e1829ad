"""Active-vocabulary settings: one typed record (:class:`VocabConfig`; defaults = the papers'
settings, ``papers/nanospec.txt`` §4 and ``papers/evospec.txt`` Table 7), read by the policies,
the serve config's ``vocab:`` section and the vocabulary flags (see ``evospec/settings.py``).
No torch: the command line reads it to build its flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from evospec.settings import setting

SHARED_BUDGET = frozenset({"nanospec+evospec"})  # policies whose window and ARC buffer share w_max


@dataclass(frozen=True)
class VocabConfig:
    """Active-vocabulary settings (the ``vocab:`` section of a serve config; the vocabulary flags)."""

    frspec_k: int | None = setting(
        None,
        "static frequency table size (frspec; evospec's core); None: 32768 for vocabularies >= 128k, "
        "else V/4 rounded up to 256",
    )
    core_k: int | None = setting(
        None,
        "evospec's static core alone (e.g. smaller than a frspec table it is compared with); None: frspec_k",
    )
    k_pre: int = setting(3, "NanoSpec: top ids per prompt position at prefill")
    k_ver: int = setting(3, "NanoSpec: top ids per verified-path node per round")
    w_max: int = setting(3072, "NanoSpec window; also the nanospec+evospec budget (window + ARC)")
    arc_capacity: int = setting(256, "EvoSpec dynamic buffer: resident ids |T1| + |T2|")
    arc_ghost: int = setting(256, "each ARC ghost list |B1|, |B2| holds at most this")
    arc_p_init: int = setting(128, "ARC's initial target size of T1 (clamped to arc_capacity)")
    arc_max_insert: int = setting(32, "ids inserted per OOV event at most")
    arc_min_residency: int = setting(8, "rounds an id stays before it may be evicted")
    arc_warmup: int = setting(50, "OOV events during which ARC's p stays at arc_p_init")
    cluster_budget: int = setting(
        4096, "DynaSpec: most ids active per round (the router's best clusters, in order, while they fit)"
    )
    candidates: int = setting(2048, "SpecVocab: candidate ids per draft step that get exact logits")
    n_top: int = setting(10, "retrieval seeds: the target's top ids at the OOV position")
    n_sem: int = setting(10, "retrieval seeds: HNSW neighbours of the target hidden state (0: off)")
    per_seed: int = setting(8, "bigram-graph successors added per seed (0: off)")
    max_pending: int = setting(
        4, "retrievals in flight before new OOV events are dropped", flag="--retrieval-max-pending"
    )
    persist: bool = setting(
        True, "keep the ARC buffer across requests (no: empty it per request)", flag="--arc-persist"
    )
    indices: str | None = setting(
        None,
        "index folder from evospec-index build; None: $EVOSPEC_HOME/indices/<model>, made on first use "
        "from the tables shipped for the model (else a checkout's shared data) plus an HNSW index built here",
    )
    corpus: str | None = setting(
        None,
        "comma-separated .txt/.jsonl/.json files or folders to count the indices from instead (built once "
        "into --indices, or $EVOSPEC_HOME/indices/<model>+corpus-<digest>; rebuilt when the files change)",
    )
    # run retrieval inline (deterministic; for tests and ablations) -- not a user setting
    synchronous: bool = setting(False, "inline retrieval", internal=True)

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
        for name in (
            "k_pre",
            "k_ver",
            "w_max",
            "arc_capacity",
            "cluster_budget",
            "candidates",
            "n_top",
            "max_pending",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"vocab.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("arc_ghost", "arc_p_init", "arc_max_insert", "arc_min_residency", "arc_warmup"):
            if getattr(self, name) < 0:  # arc_p_init above arc_capacity is clamped to it, as ARC does
                raise ValueError(f"vocab.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("n_sem", "per_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"vocab.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("frspec_k", "core_k"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"vocab.{name} must be >= 1, got {getattr(self, name)}")
        if self.indices == "":
            raise ValueError("vocab.indices must not be empty (null: the default folder)")
        if self.corpus is not None and not self.corpus_paths:
            raise ValueError("vocab.corpus must name at least one file or folder (null: the shipped tables)")

    @property
    def corpus_paths(self) -> tuple[str, ...]:
        """The files and folders of ``corpus`` (empty when None)."""
        return tuple(p.strip() for p in (self.corpus or "").split(",") if p.strip())

    @property
    def arc(self):
        """The ARC buffer's settings (``vocab/arc.py: ARCConfig``)."""
        from evospec.vocab.arc import ARCConfig

        return ARCConfig(
            capacity=self.arc_capacity,
            ghost_capacity=self.arc_ghost,
            p_init=self.arc_p_init,
            max_insert=self.arc_max_insert,
            min_residency=self.arc_min_residency,
            warmup_events=self.arc_warmup,
        )

    @property
    def nano(self):
        """The NanoSpec window's settings (``vocab/policy.py: NanoSpecConfig``)."""
        from evospec.vocab.policy import NanoSpecConfig

        return NanoSpecConfig(k_pre=self.k_pre, k_ver=self.k_ver, w_max=self.w_max)

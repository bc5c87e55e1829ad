"""The two context-dependent baselines: DynaSpec (routed clusters) and SpecVocab (per-step ranking).

Owns two :class:`~evospec.vocab.policy.VocabPolicy` implementations:

- ``dynaspec`` (:class:`DynaSpecVocab`; Zhang et al. 2025, as NanoSpec re-implements it): the
  vocabulary is cut into clusters offline (``indices/clusters.py``: 256 by spherical k-means
  over the LM-head rows); a router MLP (``router.py``) scores them from a context feature, and
  the best clusters, in score order while their union fits ``cluster_budget`` ids, are the
  round's active set (a fixed budget, not a fixed count: the clusters range from a few ids to
  ~2k). The feature is the target's at the last verified position
  (``RoundFeedback.bonus_hidden``; after the prefill, the prompt's last position): it exists at
  the accept boundary, before the draft runs, which is what lets DynaSpec route in parallel
  with drafting.
- ``specvocab`` (:class:`SpecVocabPolicy`; Williams et al. 2026): no per-round set. Every draft
  step ranks the whole vocabulary with a low-rank selector (``selector.py``) and computes exact
  logits for its top ``candidates`` ids only (``head.py: TwoStageHead``, which ``ActiveVocab``
  builds for this policy). The round's active set, for coverage, is the union of the candidate
  sets its draft steps used.
"""

from __future__ import annotations

import numpy as np
import torch

from evospec.vocab.policy import RoundFeedback, StatelessPolicy
from evospec.vocab.router import ClusterRouter, budget_prefix
from evospec.vocab.selector import LowRankSelector


class DynaSpecVocab(StatelessPolicy):
    """The router's best clusters for the current context, in score order while they fit ``budget``."""

    name = "dynaspec"
    prefill_top_k = 0

    def __init__(self, clusters: np.ndarray, router: ClusterRouter, budget: int, device="cpu") -> None:
        n_clusters = int(clusters.max()) + 1
        if router.clusters != n_clusters:
            raise ValueError(f"the router scores {router.clusters} clusters, the indices hold {n_clusters}")
        if budget < 1:
            raise ValueError(f"dynaspec: the cluster budget must be >= 1, got {budget}")
        self.cluster_of = torch.as_tensor(clusters, dtype=torch.long, device=device)  # [V]
        self.sizes = torch.bincount(self.cluster_of, minlength=n_clusters)  # [C]
        self.router = router.to(device)
        self.capacity = min(budget, clusters.shape[0])
        self.mask = torch.zeros(clusters.shape[0], dtype=torch.bool, device=device)  # [V]
        self.chosen = torch.zeros_like(self.sizes, dtype=torch.bool)  # [C] the active clusters

    @torch.inference_mode()
    def _route(self, hidden: torch.Tensor | None) -> None:
        if hidden is None:  # no context feature (a caller without features): clusters by id
            scores = -torch.arange(self.sizes.numel(), dtype=torch.float32, device=self.sizes.device)
        else:
            scores = self.router(hidden.reshape(1, -1).float())[0]  # [C]
        self.chosen = budget_prefix(scores[None], self.sizes, self.capacity)[0]  # [C] bool
        self.mask = self.chosen[self.cluster_of]  # [V]

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        self._route(last_hidden)

    def active_mask(self, round_index: int) -> torch.Tensor:
        return self.mask

    def observe(self, fb: RoundFeedback) -> None:
        self._route(fb.bonus_hidden)  # the next round's context: the last verified position

    def state(self) -> dict:
        return {
            "policy": self.name,
            "budget": self.capacity,
            "clusters": torch.nonzero(self.chosen).flatten().tolist(),
            "active_size": int(self.mask.sum()),
        }


class SpecVocabPolicy(StatelessPolicy):
    """Per-step candidates from a low-rank selector; the head does the work (``TwoStageHead``)."""

    name = "specvocab"
    prefill_top_k = 0

    def __init__(self, selector: LowRankSelector, vocab_size: int, candidates: int) -> None:
        if not 1 <= candidates <= vocab_size:
            raise ValueError(f"specvocab: candidates must be in [1, {vocab_size}], got {candidates}")
        self.selector = selector
        self.candidates = candidates
        self.capacity = candidates  # exact logits per draft row
        self.vocab_size = vocab_size

    def start(self, prompt: torch.Tensor, prefill_top: torch.Tensor | None, last_hidden=None) -> None:
        pass

    def active_mask(self, round_index: int) -> torch.Tensor:
        raise RuntimeError("specvocab chooses candidates per draft step (TwoStageHead), not per round")

    def observe(self, fb: RoundFeedback) -> None:
        pass

    def state(self) -> dict:
        return {"policy": self.name, "candidates": self.candidates, "rank": self.selector.rank}

"""DynaSpec's router: a small MLP that scores the vocabulary clusters from a context feature.

Owns: :class:`ClusterRouter` ([n, D] target feature -> [n, C] cluster scores; Linear -> SiLU ->
Linear), :func:`budget_prefix` (which clusters a score vector activates under an id budget),
its file (``dynaspec.safetensors`` in the index directory: weights, plus metadata binding it to
the cluster table it was trained on and the LM head it scores for) and :func:`load_router`,
which refuses a router that does not fit the served model or clusters.

Trained by ``evospec train-vocab dynaspec`` (``evospec/train/vocab_models.py``); read by the
``dynaspec`` policy (``vocab/routed.py``). Knows nothing about how rounds use the scores.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

DEFAULT_ROUTER_HIDDEN = 1024
RETRAIN = "evospec train-vocab dynaspec --model MODEL --out DIR (the indices folder it is served from)"


class ClusterRouter(nn.Module):
    """[n, D] -> [n, C] cluster logits."""

    def __init__(self, dim: int, clusters: int, hidden: int = DEFAULT_ROUTER_HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, clusters)

    @property
    def clusters(self) -> int:
        return self.fc2.out_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.silu(self.fc1(h)))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def budget_prefix(scores: torch.Tensor, sizes: torch.Tensor, budget: int) -> torch.Tensor:
    """[n, C] bool: per row, the clusters in score order while their total size fits ``budget``
    ids (scores [n, C]; sizes [C] ids per cluster)."""
    order = torch.argsort(scores, dim=-1, descending=True)  # [n, C]
    fits = torch.cumsum(sizes[order], dim=-1) <= budget  # [n, C] the best prefix within budget
    return torch.zeros_like(fits).scatter_(1, order, fits)


def clusters_digest(clusters: np.ndarray) -> str:
    """sha256 (16 hex digits) of a cluster table: what a router is bound to."""
    return hashlib.sha256(np.ascontiguousarray(clusters, dtype=np.int64).tobytes()).hexdigest()[:16]


def save_router(router: ClusterRouter, path: Path, *, clusters: np.ndarray, fingerprint: str) -> None:
    """Write the router in fp16 with what binds it (cluster digest, LM-head fingerprint)."""
    from evospec.common import save_tensors

    tensors = {k: v.detach().to(torch.float16).contiguous().cpu() for k, v in router.state_dict().items()}
    meta = {
        "kind": "dynaspec-router",
        "dim": str(router.fc1.in_features),
        "hidden": str(router.fc1.out_features),
        "clusters": str(router.clusters),
        "clusters_sha256": clusters_digest(clusters),
        "model_fingerprint": fingerprint,
    }
    save_tensors(tensors, str(path), metadata=meta)


def load_router(trained, *, clusters: np.ndarray, fingerprint: str, dtype=torch.float32, device="cpu"):
    """The :class:`ClusterRouter` of an index bundle's ``dynaspec`` file (``TrainedFile``);
    ``ValueError`` naming the mismatch when it was trained for other clusters or another model."""
    meta = trained.check("dynaspec-router", fingerprint, RETRAIN)
    if meta.get("clusters_sha256") != clusters_digest(clusters):
        raise ValueError(
            "the DynaSpec router was trained on other vocabulary clusters than the indices hold; "
            f"retrain it: {RETRAIN}"
        )
    router = ClusterRouter(int(meta["dim"]), int(meta["clusters"]), int(meta["hidden"]))
    router.load_state_dict({k: v.float() for k, v in trained.tensors.items()})
    return router.to(device=device, dtype=dtype).eval().requires_grad_(False)

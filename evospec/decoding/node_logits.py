"""Target logits of verified tree nodes, projected only where acceptance will look.

Owns: :class:`NodeLogits` (lazy, prefetching row source for ``verify.py``) and
:func:`calibrate_prefetch` (the prefetch threshold from this machine's LM-head costs).

Why: acceptance reads the target's logits at the root and then only along the accepted path
(greedy: its argmaxes; sampling: its distributions), yet the verify forward used to project
every tree node onto the full vocabulary. On a CPU that projection is a real part of a
verify: a 61-node SmolLM2 tree spends much of it on rows nobody reads (lazy rows cut its
verify from 229 to 201 ms per round, ``docs/engine.md``). Here the verify forward stops at the
features (``logits="none"``) and rows are projected on demand through the target's own LM
head (``Transformer.project_logits``: the same weights, kernel and soft-capping).

Prefetch rule: a request for node u also projects, in the same call, u's not yet projected
descendants d whose draft probability given u, exp(score_d - score_u), is at least
``prefetch``. One call then covers the continuation the draft itself expects to be
accepted. ``prefetch`` = 1 projects the path only (one call per accepted token, like plain
decoding); 0 projects u's whole subtree at once. The right value is the ratio of one extra
row's cost to a call's fixed cost (:func:`calibrate_prefetch`).

Lossless either way: each row is the target's exact logits for that node's features; only
which rows are computed, and how they are batched, changes.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from evospec.decoding.tree import DraftTree

Projector = Callable[[torch.Tensor], torch.Tensor]  # [k, D] features -> [k, V] logits


class NodeLogits:
    """``rows[node]`` -> that node's target logits [V], projected on first use."""

    def __init__(self, tree: DraftTree, hidden: torch.Tensor, project: Projector, prefetch: float) -> None:
        self.tree = tree
        self.hidden = hidden  # [N, D] the verify forward's features of every node
        self.project = project
        self.log_prefetch = math.log(prefetch) if prefetch > 0 else -math.inf
        self._rows: dict[int, torch.Tensor] = {}
        self._scores: list[float] | None = None
        self.calls = 0  # projection calls made
        self.projected = 0  # rows projected

    def __getitem__(self, node: int) -> torch.Tensor:
        row = self._rows.get(node)
        if row is None:
            want = [node, *self._prefetch(node)]
            idx = torch.tensor(want, device=self.hidden.device)
            out = self.project(self.hidden[idx])  # [k, V]
            self.calls += 1
            self.projected += len(want)
            for i, n in enumerate(want):
                self._rows[n] = out[i]
            row = self._rows[node]
        return row

    def stack(self, nodes: list[int]) -> torch.Tensor:
        """[len(nodes), V] the rows of ``nodes`` (e.g. the accepted path)."""
        return torch.stack([self[n] for n in nodes])

    def _prefetch(self, node: int) -> list[int]:
        if self.tree.size == 1:
            return []
        if self._scores is None:
            self._scores = self.tree.scores.tolist()
        s = self._scores
        below = torch.nonzero(self.tree.mask[:, node]).flatten().tolist()  # node and its descendants
        return [d for d in below if d != node and d not in self._rows and s[d] - s[node] >= self.log_prefetch]


def calibrate_prefetch(project: Projector, hidden_size: int, *, device=None, dtype=torch.float32) -> float:
    """The prefetch threshold for ``project`` on this machine: (cost of one extra row in a
    call) / (cost of a call's first row), clamped to [0.01, 1].

    A descendant whose acceptance chance p exceeds that ratio is cheaper to project now than
    to risk a call of its own later. Bandwidth-bound heads (a huge vocabulary on a CPU) get a
    small ratio and prefetch widely; compute-bound ones project little more than the path.
    Costs are medians of a few timed calls (about 20 one-row projections in all).
    """
    x1 = torch.zeros(1, hidden_size, device=device, dtype=dtype)
    x8 = torch.zeros(8, hidden_size, device=device, dtype=dtype)

    def median_s(x: torch.Tensor) -> float:
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            project(x)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    with torch.inference_mode():
        t1, t8 = median_s(x1), median_s(x8)
    per_row = max((t8 - t1) / 7, 0.0)
    fixed = max(t1 - per_row, 1e-9)
    return min(max(per_row / fixed, 0.01), 1.0)

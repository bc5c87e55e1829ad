"""Recorded draft steps (CPU): an EAGLE head's forward without Python's per-op cost.

Owns: :class:`DraftStepGraph`, which records a draft head's step (EAGLE-2: embedding, ``fc``,
its decoder layer; EAGLE-3: ``fc`` over the three target layers where the input is theirs,
its layer on [embedding, feature]; both with the KV-cache write) with ``torch.jit.trace`` once
per row count n <= ``MAX_CHAIN`` and input width, and runs later calls of that shape through
the graph: one new pair (a chain's expansion, a round's catch-up after a rejection) or n pairs
that attend causally behind the cache (a catch-up after accepted tokens; row j sees the cache
and rows 0..j, as ``models/step.py`` records chains). The cache length reaches the graph as
the size of a slot tensor, so one graph serves every position. Widths: an EAGLE-2 head reads
[D] features everywhere; an EAGLE-3 head reads [3 D_t] target features when it commits and
its own [D] ones when a chain expands (one row).

Why: a draft step is ~100 aten calls for one small layer; from Python they cost about as much
as the layer's int8 weights take to read. Draft numbers only decide what is proposed, never
what is emitted (the target verifies), so the graph's attention may round differently from
the eager masked attention; the tests check that it proposes what the eager step proposes.

Scope: heads whose modules the tracer can follow (the int8 drafting copy, or fp32 linears
that are not oneDNN-packed); a head that adapts online keeps the eager path (its modules
change). If recording fails, that is logged once and the eager step runs from then on.
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from torch import nn

from evospec.models.kv_cache import SlotCache
from evospec.models.packing import PackedMatmul
from evospec.models.step import MAX_CHAIN, _ChainRow, warm

log = logging.getLogger(__name__)


class _DraftStep(nn.Module):
    """(features [1, n, D], tokens [1, n], positions [n], k, v, slots [length + n]) -> [1, n, D]."""

    def __init__(self, head: nn.Module, n: int) -> None:
        super().__init__()
        self.head = head
        self.embedding = head.embedding()  # the target's (shared): a submodule here, so traced as a weight
        self.rows = None if n == 1 else [_ChainRow(n - 1 - j) for j in range(n)]

    def forward(self, features, tokens, positions, k, v, slots):
        return self.head.step(features, tokens, positions, SlotCache(k, v, slots), None, self.rows)


def supports_draft_graph(head: nn.Module) -> bool:
    """An EAGLE-2 or EAGLE-3 head without oneDNN-packed linears (their weight is an opaque
    tensor)."""
    if getattr(head, "arch", None) not in ("eagle2", "eagle3"):
        return False
    return not any(isinstance(v, PackedMatmul) for mod in head.modules() for v in vars(mod).values())


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> its DraftStepGraph


def draft_graph_for(head: nn.Module) -> DraftStepGraph:
    """The one :class:`DraftStepGraph` of ``head``: decoders drafting with the same head (the
    shared int8 copy; the tuner's candidate shapes) record each row count once."""
    if head not in _SHARED:
        _SHARED[head] = DraftStepGraph(head)
    return _SHARED[head]


def on_cpu(head: nn.Module) -> bool:
    """True when ``head`` computes on the CPU (read off its norms: they stay dense in every
    weight format)."""
    return next(p for name, p in head.named_parameters() if "norm" in name).is_cpu


class DraftStepGraph:
    """Runs a head's n-pair causal steps through graphs recorded on first use."""

    def __init__(self, head: nn.Module) -> None:
        if not supports_draft_graph(head):
            raise ValueError("a recorded draft step needs an EAGLE head without packed fp32 linears")
        self.head = head
        self._graphs: dict[tuple[int, int], torch.jit.ScriptModule] = {}  # (rows, input width)
        self._slots = torch.zeros(64)
        self.failed = False
        own = head.cfg.hidden_size
        target = head.fc.in_features if head.arch == "eagle3" else own  # EAGLE-3: 3 D_t
        # n-pair steps read the target's features; one row may also be the head's own (an expansion)
        self._widths = ((target,) if target == own else (target, own), (target,))

    def widths(self, n: int) -> tuple[int, ...]:
        """The feature widths an n-pair step reads: the target's (3 D_t for EAGLE-3, whose
        commits fuse three layers), and for one row also the head's own D (a chain's expansion)."""
        return self._widths[n > 1]

    def __call__(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache):
        """Append n pairs (features [n, D], tokens [n]) at slot ``cache.length``, each attending
        to the cache and the pairs before it; returns [n, D] and advances the cache, or None
        where no graph serves (the caller runs the eager step)."""
        n, key = tokens.shape[0], (tokens.shape[0], features.shape[-1])
        end = cache.length + n
        if self.failed or n > MAX_CHAIN or end > cache.max_len or key[1] not in self.widths(n):
            return None
        if key not in self._graphs and not self.record(n):
            return None
        if self._slots.shape[0] < end:
            self._slots = torch.zeros(max(end, 2 * self._slots.shape[0]), device=cache.k.device)
        out = self._graphs[key](features[None], tokens[None], positions, cache.k, cache.v, self._slots[:end])
        cache.advance(n)
        return out[0]

    def record(self, n: int) -> bool:
        """Record (and warm, ``step.warm``) the n-pair graphs of every width now, so that no
        round waits for them; False if recording failed (the eager step runs from then on)."""
        for width in self.widths(n):
            if self.failed or (n, width) in self._graphs:
                continue
            self._record(n, width)
        return not self.failed

    def _record(self, n: int, width: int) -> None:
        # Record on scratch K/V after a 2-slot prefix, so that no length is taken for a constant.
        scratch = self.head.new_cache(n + 3)
        scratch_k, scratch_v = scratch.k, scratch.v
        device, dtype = scratch_k.device, scratch_k.dtype
        example = (
            torch.zeros(1, n, width, dtype=dtype, device=device),
            torch.zeros(1, n, dtype=torch.long, device=device),
            torch.arange(2, 2 + n, device=device),
            scratch_k,
            scratch_v,
            torch.zeros(2 + n, device=device),
        )
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace
                graph = torch.jit.trace(_DraftStep(self.head, n), example, check_trace=False)
                warm(graph, example)
                self._graphs[n, width] = graph
        except Exception:  # any tracer failure means: stay eager
            log.warning("could not record the draft step; drafting eagerly", exc_info=True)
            self.failed = True

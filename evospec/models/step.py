"""Decode steps as recorded graphs (CPU): the same kernels without Python's per-op cost.

Owns: :class:`StepGraph`, which records a :class:`~evospec.models.transformer.Transformer`'s
own blocks with ``torch.jit.trace`` -- once per forward shape: a one-token step, or an n-token
chain verified row by row (each row sees the cache and the rows before it, the row-exact
attention of ``transformer.py``) -- and then runs every later forward of that shape through
its graph. The cache length reaches a graph as the size of a slot tensor (``slots``:
[length + n]), which tracing keeps symbolic, so one graph serves every position and every
cache; the caches' K/V tensors are inputs, not constants. Graphs are recorded ahead by
:meth:`StepGraph.record` (the assembly does it for the decoders it builds) or at first use.

Why: a SmolLM2-135M step is ~60 aten calls and 5 module calls per layer; run from Python that
costs ~1.4 ms of an 8.3 ms int4 step on this CPU (median of 120 steps, 2 threads: 8.26 eager
vs 6.87 ms recorded). A graph makes the same aten calls in the same order with the same
arguments, so its logits are bitwise those of the eager forward (tested), and verification
still reproduces plain decoding's. ``torch.compile`` was tried first: it recompiled at every
new cache length (~50 s each) and fused the elementwise ops (other rounding).

If recording fails (a module the tracer cannot follow, a torch without ``torch.jit``), that
is logged once and the eager forward runs from then on.

Draft trees of up to ``MAX_TREE`` (64) nodes are recorded too where the whole stack is one
``llama_stack`` op (``fused.supports_tree_rows``): the tree's ancestor bits are one more input
(``fused.TreeRows``), each row getting the bits of a one-token step at its node.

Scope: one sequence, no attention mask, chains of up to ``MAX_CHAIN`` tokens (and trees, above).
Models with sliding-window layers (Gemma-3) are recorded only on the fused ops, whose attention
hides the keys past the window itself (elsewhere their one-token masks depend on the position);
oneDNN-packed fp32 linears (``--weights fp32``: an opaque weight tensor) keep the eager path, as
do branching trees where the stack is not one op, batches and prefill. The graphs hold the
modules' weights by reference: changing the model's modules afterwards needs
:meth:`StepGraph.reset`.
"""

from __future__ import annotations

import logging
import warnings
from typing import ClassVar

import torch
from torch import nn

from evospec.models.fused import TreeRows, supports_tree_rows
from evospec.models.kv_cache import SlotCache
from evospec.models.packing import PackedMatmul

log = logging.getLogger(__name__)


class _ChainRow:
    """Row j of an n-token chain, as :class:`~evospec.models.transformer.RowAttention` has it
    for row-exact verification: it sees the cache up to its own slot (a view, as a one-token
    step at its position does), found from the keys' symbolic length."""

    masks: ClassVar[dict] = {False: None, True: None}  # a one-token step's (sliding layers: the op windows)
    index = None  # its keys are a view of the cache, as RowAttention's chain rows

    def __init__(self, back: int) -> None:
        self.back = back  # n - 1 - j: slots after this row's own

    def keys(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = keys.shape[2] - self.back
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)


class _Step(nn.Module):
    """(tokens [1, n], positions [n], k, v, slots [length + n][, tree bits [n]]) -> (logits,
    hidden [1, n, D], *the outputs of ``aux`` layers); logits [1, n, V] (``all``), [1, 1, V]
    (``last``) or absent (``none``). ``tree``: the rows are a draft tree's (``fused.TreeRows``)."""

    def __init__(
        self, model: nn.Module, n: int, logits: str, aux: tuple[int, ...] = (), tree: bool = False
    ) -> None:
        super().__init__()
        self.model, self.logits, self.aux, self.tree = model, logits, aux, tree
        self.rows = None if n == 1 else [_ChainRow(n - 1 - j) for j in range(n)]

    def forward(self, tokens, positions, k, v, slots, *tree_bits):
        m = self.model
        x = m.embed_tokens(tokens)
        if m.cfg.embed_scale != 1.0:
            x = x * torch.tensor(m.cfg.embed_scale, dtype=x.dtype)
        rope_g = m.rope_global(positions, x.dtype)
        rope_l = m.rope_local(positions, x.dtype) if m.cfg.is_gemma else rope_g
        cache = SlotCache(k, v, slots)
        rows = TreeRows(tree_bits[0]) if self.tree else self.rows
        x, aux = m.run_layers(x, (rope_g, rope_l), cache, {False: None, True: None}, rows, self.aux)
        hidden = m.norm(x)
        if self.logits == "none":
            return (hidden, *aux)
        return (m.project_logits(hidden[:, -1:] if self.logits == "last" else hidden), hidden, *aux)


def supports_step_graph(model: nn.Module) -> bool:
    """True where a step can be recorded and reproduces the eager one: no sliding-window
    layers unless on the fused ops (whose attention applies the window), and no
    oneDNN-packed fp32 linears (their packed weight is an opaque tensor that a recorded graph
    cannot hold; the quantised formats' plain tensors it can)."""
    cfg = model.cfg
    if any(cfg.is_sliding(i) for i in range(cfg.num_layers)) and not getattr(model, "fused_ops", False):
        return False
    return not any(isinstance(v, PackedMatmul) for mod in model.modules() for v in vars(mod).values())


MAX_CHAIN = 16  # longest chain recorded (one graph per length and logits mode)
MAX_TREE = 64  # largest tree recorded (the op's bit sets): EAGLE-2's default 10/5/60 tree fits
# A traced graph's first calls run through the JIT's profiling executor before it settles on an
# optimised plan: here a draft step took ~30 / 12 / 5 ms on its first three calls, then 0.4 ms;
# a SmolLM2 verify ~170 / 160 / 11 ms, then 8 ms. Recording makes those calls on the scratch
# inputs (the plan carries over to real caches of any length), so no round pays them.
WARM_CALLS = 3


def warm(graph: torch.jit.ScriptModule, example: tuple) -> torch.jit.ScriptModule:
    """``graph`` after :data:`WARM_CALLS` calls on ``example`` (scratch inputs it may write)."""
    with torch.inference_mode():
        for _ in range(WARM_CALLS):
            graph(*example)
    return graph


class StepGraph:
    """Runs a model's one-token steps and n-token chain verifications through graphs recorded
    on first use (one per length and logits mode)."""

    def __init__(self, model: nn.Module) -> None:
        if not supports_step_graph(model):
            raise ValueError(
                "the one-token step graph needs a model without packed fp32 linears, and sliding-window "
                "layers only on the fused CPU ops"
            )
        self.model = model
        self.trees = supports_tree_rows(model)  # draft trees verified through graphs too
        self._graphs: dict[tuple, torch.jit.ScriptModule] = {}  # (n, logits[, aux layers][, "tree"]) -> graph
        self._slots = torch.zeros(64)
        self.failed = False  # recording failed: the eager forward runs

    def reset(self) -> None:
        """Forget the recorded graphs (after swapping the model's modules)."""
        self._graphs, self.failed = {}, False
        self.trees = supports_tree_rows(self.model)

    def takes_tree(self, n: int, aux: tuple[int, ...] = ()) -> bool:
        """Whether an n-node draft tree's forward (without ``aux`` layers) runs through a graph:
        what the target's forward routes there and what a verify projects in it."""
        return self.trees and not self.failed and not aux and n <= MAX_TREE

    @staticmethod
    def _key(n: int, logits: str, aux: tuple[int, ...], tree: bool = False) -> tuple:
        key = (n, logits) if not aux else (n, logits, tuple(aux))
        return (*key, "tree") if tree else key

    def record(self, n: int, logits: str = "last", aux: tuple[int, ...] = (), tree: bool = False) -> bool:
        """Record the graph for ``n``-token forwards with ``logits`` (and the outputs of layers
        ``aux``, for EAGLE-3 drafts; ``tree``: of a draft tree's rows, where :attr:`trees`) now
        (~1 s for SmolLM2 here), so that the first request does not wait for it. False if
        recording failed."""
        if tree and (aux or not self.trees):
            raise ValueError("tree forwards are recorded on one llama_stack op, without aux layers")
        key = self._key(n, logits, aux, tree)
        if key not in self._graphs and not self.failed and n <= (MAX_TREE if tree else MAX_CHAIN):
            try:
                self._graphs[key] = self._record(n, logits, self.model.new_cache(n + 3), tuple(aux), tree)
            except Exception:  # any tracer failure means: stay eager
                log.warning("could not record the decode step; decoding eagerly", exc_info=True)
                self.failed = True
        return not self.failed

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache,
        logits: str = "last",
        aux: tuple[int, ...] = (),
        tree: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]] | None:
        """Append ``tokens`` ([1, n]: one token, a chain each of whose rows sees the cache
        and the rows before it, or with ``tree`` -- ``fused.TreeRows``' bits [n], where
        :attr:`trees` -- a draft tree's nodes) at slot ``cache.length``; returns (logits or None
        for ``none``, hidden [1, n, D], the outputs of layers ``aux``), or None where no graph
        could be recorded (run eagerly). The caller advances the cache."""
        n = tokens.shape[1]
        end = cache.length + n
        if end > cache.max_len:
            raise ValueError(f"KV cache overflow: need {end} slots, have {cache.max_len}")
        if n > (MAX_CHAIN if tree is None else MAX_TREE) or self.failed:
            return None
        if self._slots.shape[0] < end or self._slots.device != cache.k.device:
            self._slots = torch.zeros(max(end, 2 * self._slots.shape[0]), device=cache.k.device)
        key = self._key(n, logits, aux, tree is not None)
        if key not in self._graphs and not self.record(n, logits, aux, tree is not None):
            return None
        extra = () if tree is None else (tree,)
        out = self._graphs[key](tokens, positions, cache.k, cache.v, self._slots[:end], *extra)
        if logits == "none":
            return None, out[0], list(out[1:])
        return out[0], out[1], list(out[2:])

    def _record(
        self, n: int, logits: str, cache, aux: tuple[int, ...] = (), tree: bool = False
    ) -> torch.jit.ScriptModule:
        # Record on scratch K/V (the real cache is written by the first real call), after a
        # 2-slot prefix so that no length is mistaken for a constant.
        device = cache.k.device
        scratch_k = torch.zeros_like(cache.k[:, :, :, : n + 3])
        scratch_v = torch.zeros_like(scratch_k)
        tokens = torch.zeros(1, n, dtype=torch.long, device=device)
        positions = torch.arange(2, 2 + n, device=device)
        example = (tokens, positions, scratch_k, scratch_v, torch.zeros(2 + n, device=device))
        if tree:  # a chain's bits: every row sees the rows before it
            example += ((1 << torch.arange(1, n + 1, device=device)) - 1,)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace, see above
            graph = torch.jit.trace(_Step(self.model, n, logits, aux, tree), example, check_trace=False)
        return warm(graph, example)

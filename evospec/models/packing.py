"""Prepacked fp32 matmuls for CPU inference (oneDNN's blocked weight layout).

Owns: :class:`PackedMatmul` (``y = x @ W.T + b`` with ``W`` reordered once into oneDNN's
blocked layout; ``W`` may stack several weights that share an input, e.g. q/k/v) and
:func:`pack_linears`, which swaps a frozen model's ``nn.Linear`` modules for
:class:`PackedLinear` in place and fuses the groups a module declares in ``FUSED``, keeping
parameter names, tied weights and the dense weight itself (loading, tied embeddings and
vocabulary row gathers still read it); and :class:`PackedRows`, the block-packed product
over the reduced draft heads' row buffer, which changes a few rows at a time.

Why: on these CPUs plain MKL handles the small row counts of decoding badly. Measured with
``scripts/bench_linear.py`` (all SmolLM2-135M linears): 2-4 rows ~2.2x faster than
``F.linear``, 8-16 rows ~1.4-1.6x, one row ~1.3x; 2-4 rows then cost ~1.1x one row.

Contract:
- Results equal ``F.linear`` up to fp32 rounding (max abs diff ~1e-5 at these sizes); they
  differ in the last bits, as any two GEMM kernels do, so lossless checks compare a method
  with plain decoding run through the *same* modules.
- Only CPU fp32 weights are packed (:func:`packing_available`); anything else keeps
  ``F.linear``. A call that needs autograd (grad mode on and an input or weight requiring
  grad) takes ``F.linear`` too, so training code can share a packed module.
- A packed weight is repacked when a dense source is modified in place (its version counter
  moved), so ``load_state_dict`` after packing cannot leave a stale copy.
- Memory: one extra copy of every weight in use (fused groups are packed once, as a group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Rows oneDNN is told to expect when it picks the blocked layout. Measured on these CPUs
# (Gemma-3-270M's shapes, all layers): a hint of 1 makes 2-4-row calls ~1.4-1.7x slower than
# hints of 4-64, which all cost the same as it at one row; tree verification runs 2-16 rows.
BATCH_HINT = 16


def packing_available(weight: torch.Tensor) -> bool:
    """True when ``weight`` can take the oneDNN path (CPU, fp32, oneDNN built in)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter: it cannot change later
        return -1


class PackedMatmul:
    """``y = x @ W.T (+ b)`` through one reordered copy of ``W = cat(weights)`` [sum(out), in].

    Several weights sharing an input (q/k/v, gate/up) become one call whose output the caller
    splits by :attr:`sizes`: fewer, larger matmuls, which is where these CPUs are efficient.
    """

    def __init__(
        self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None
    ) -> None:
        weights = tuple(weights)
        biases = tuple(biases) if biases is not None else (None,) * len(weights)
        if not weights or len(biases) != len(weights):
            raise ValueError("PackedMatmul needs one bias (or None) per weight and at least one weight")
        for w in weights:
            if not packing_available(w) or w.shape[1] != weights[0].shape[1]:
                raise ValueError(f"cannot pack a {w.dtype} {tuple(w.shape)} weight on {w.device} with these")
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("either every fused weight has a bias or none has")
        self.weights = weights  # each [out_i, in], shared with the owners
        self.biases = biases  # each [out_i] or None
        self.sizes = [w.shape[0] for w in weights]
        self._packed: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._seen: tuple[int, ...] = ()  # source versions the packed copy was made from

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The oneDNN copy and fused bias, (re)made when a source changed since the last call."""
        versions = tuple(_version(t) for t in (*self.weights, *self.biases) if t is not None)
        if self._packed is None or versions != self._seen:
            with torch.no_grad():
                w = _cat(self.weights).detach()
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
                self._bias = None if self.biases[0] is None else _cat(self.biases).detach()
            self._seen = versions
        return self._packed, self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., sum(out)]
        if x.dtype != torch.float32 or x.device.type != "cpu" or _needs_grad(x, *self.weights, *self.biases):
            bias = None if self.biases[0] is None else _cat(self.biases)
            return F.linear(x, _cat(self.weights), bias)
        packed, bias = self.packed()
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class PackedLinear(nn.Module):
    """Drop-in for a frozen ``nn.Linear``: same ``weight`` / ``bias`` parameters, packed matmul."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: ties and state-dict names survive
        self.bias = linear.bias
        self.matmul = PackedMatmul([self.weight], [self.bias])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; returns how many.

    Modules that declare ``FUSED = {attr: (child, child, ...)}`` (linears sharing an input)
    also get ``attr`` set to one :class:`PackedMatmul` over those children, which their
    forward then uses instead of the separate calls (packing is lazy, so the unused separate
    copies cost nothing). Idempotent. Call after the weights are loaded (later in-place
    edits are still picked up).
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_available(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
    for module in model.modules():
        for attr, names in getattr(module, "FUSED", {}).items():
            parts = [getattr(module, n) for n in names]
            if all(isinstance(p, PackedLinear) for p in parts) and getattr(module, attr) is None:
                setattr(module, attr, PackedMatmul([p.weight for p in parts], [p.bias for p in parts]))
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears` (plain ``nn.Linear`` modules on the same parameters)."""
    for module in model.modules():
        for attr in getattr(module, "FUSED", {}):
            setattr(module, attr, None)
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                linear = nn.Linear(
                    child.in_features, child.out_features, bias=child.bias is not None, device="meta"
                )
                linear.weight = child.weight
                linear.bias = child.bias
                setattr(parent, name, linear)
                count += 1
    return count


def projection(linear: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ linear.weight.T`` through ``linear``'s packed or quantised copy when it has one.

    For code that projects onto a model's LM head outside the model (draft heads, prefill
    top-k): it shares the target's packed (or int8/int4, see ``quant.py``) weight instead of
    making another copy.
    """
    matmul = getattr(linear, "matmul", None)  # PackedLinear / QuantLinear: the whole output
    if matmul is not None:
        return matmul
    weight = linear.weight
    return lambda x: x @ weight.T


class PackedRows:
    """``y = x @ rows.T`` over a row buffer [C, D] that changes a few rows at a time.

    The reduced draft heads' buffer: tens of thousands of rows loaded once per request (the
    FR-Spec table, the EvoSpec core) plus a few slots rewritten per OOV event. The buffer is
    packed in blocks of ``block`` rows, and only the blocks holding rewritten rows are
    repacked. Measured on this CPU (one row, 16,582 x 640, ``scripts/bench_linear.py --rows
    16582 --hidden 640``, three runs): dense 2.8-3.9 ms, 4,096-row blocks 2.4-3.0 ms; one block
    repacked plus a call ~5.4 ms, so a block rewritten every round would not pay.

    Contract: the owner calls :meth:`touch` with the slots it wrote, right after writing
    them. A write that bypasses :meth:`touch` is still caught when the buffer has a version
    counter (everything is repacked then); one made under inference mode is not, so such
    owners must call :meth:`invalidate`. Inputs that are not fp32 on the CPU, or that need
    autograd, take the dense product.
    """

    def __init__(self, rows: torch.Tensor, block: int = 4096) -> None:
        if not packing_available(rows):
            raise ValueError(f"cannot pack a {rows.dtype} {tuple(rows.shape)} buffer on {rows.device}")
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.rows = rows  # [C, D], owned and written by the caller
        self.block = block
        n = -(-rows.shape[0] // block)
        self._packed: list[torch.Tensor | None] = [None] * n
        self._dirty: set[int] = set(range(n))
        self._seen = _version(rows)
        self.repacked_blocks = 0  # blocks (re)packed so far, for tests and timings

    def touch(self, slots: torch.Tensor) -> None:
        """Rows at ``slots`` ([a] int) were just rewritten: repack their blocks before the next call."""
        if slots.numel():
            self._dirty.update((slots // self.block).unique().tolist())
        self._seen = _version(self.rows)

    def invalidate(self) -> None:
        """Repack every block before the next call."""
        self._dirty = set(range(len(self._packed)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [n, D] -> [n, C]
        if x.dtype != torch.float32 or x.device.type != "cpu" or _needs_grad(x, self.rows):
            return x @ self.rows.T
        if _version(self.rows) != self._seen:  # written without touch()
            self.invalidate()
        if self._dirty:
            with torch.no_grad():
                for b in sorted(self._dirty):
                    part = self.rows[b * self.block : (b + 1) * self.block].detach().contiguous()
                    self._packed[b] = torch.ops.mkldnn._reorder_linear_weight(part, BATCH_HINT)
            self.repacked_blocks += len(self._dirty)
            self._dirty.clear()
            self._seen = _version(self.rows)
        outs = [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in self._packed]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

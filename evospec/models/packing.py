"""Prepacked fp32 matmuls for CPU inference (oneDNN's blocked weight layout).

Owns: :class:`PackedMatmul` (``y = x @ W.T + b`` with ``W`` reordered once into oneDNN's
blocked layout) and :func:`pack_linears`, which swaps a frozen model's ``nn.Linear`` modules
for :class:`PackedLinear` in place, keeping parameter names, tied weights and the dense
weight itself (loading, tied embeddings and vocabulary row gathers still read it).

Why: on these CPUs plain MKL handles the small row counts of decoding badly; reordering the
weight once is the largest single CPU win measured (``PERF_NOTES.md``): tree verification and
a full-vocabulary draft head at 8-60 rows run ~1.5-3x faster, one-row decoding modestly so.

Contract:
- Results equal ``F.linear`` up to fp32 rounding (max abs diff ~1e-5 at these sizes); they
  differ in the last bits, as any two GEMM kernels do, so lossless checks compare a method
  with plain decoding run through the *same* modules.
- Only CPU fp32 weights are packed (:func:`packing_available`); anything else keeps
  ``F.linear``. A call that needs autograd (grad mode on and an input or weight requiring
  grad) takes ``F.linear`` too, so training code can share a packed module.
- A packed weight is repacked when the dense weight is modified in place (its version
  counter moved), so ``load_state_dict`` after packing cannot leave a stale copy.
- Memory: one extra copy of every packed weight.
"""

from __future__ import annotations

from collections.abc import Callable

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
    """``y = x @ weight.T (+ bias)`` through a once-reordered copy of ``weight`` [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if not packing_available(weight):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device}")
        self.weight = weight  # [out, in] dense, shared with the owner
        self.bias = bias  # [out] or None
        self._packed: torch.Tensor | None = None
        self._seen = -2  # weight version the packed copy was made from

    def packed(self) -> torch.Tensor:
        """The oneDNN copy, (re)made when the dense weight changed since the last call."""
        version = _version(self.weight)
        if self._packed is None or version != self._seen:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BATCH_HINT)
            self._seen = version
        return self._packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if x.dtype != torch.float32 or x.device.type != "cpu" or _needs_grad(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed(), self.bias, "none", [], "")


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class PackedLinear(nn.Module):
    """Drop-in for a frozen ``nn.Linear``: same ``weight`` / ``bias`` parameters, packed matmul."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter object: ties and state-dict names survive
        self.bias = linear.bias
        self.matmul = PackedMatmul(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace every packable ``nn.Linear`` in ``model`` by a :class:`PackedLinear`; returns how many.

    Idempotent. Call after the weights are loaded (later in-place edits are still picked up).
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and packing_available(child.weight):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears` (plain ``nn.Linear`` modules on the same parameters)."""
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
    """``x -> x @ linear.weight.T`` through ``linear``'s packed copy when it has one.

    For code that projects onto a model's LM head outside the model (draft heads, prefill
    top-k): it shares the target's packed weight instead of making another copy.
    """
    if isinstance(linear, PackedLinear):
        return linear.matmul
    weight = linear.weight
    return lambda x: x @ weight.T

"""Weight-only quantised linears for CPU decoding: int4 (group 32), int8 (per row), bf16.

Owns: the weight formats (:data:`WEIGHT_FORMATS`), the 4-bit group codes a weight is stored
as (:class:`GroupCodes`, filled from GGUF blocks without re-quantising, or from a float
weight by the rule below), the three matmuls over torch's CPU weight-only kernels
(:class:`Int4Matmul`, :class:`Int8Matmul`, :class:`Bf16Matmul`), and
:func:`quantize_linears`, which swaps a loaded model's linears for :class:`QuantLinear` in
place (fusing the groups a module declares in ``FUSED``, like ``packing.pack_linears``).

Why: decoding reads every weight once per forward, so on a CPU its speed is bytes per token
over memory bandwidth. Measured with ``scripts/bench_linear.py --formats`` (all 210 SmolLM2
linears, ms at 1 / 4 / 16 rows): oneDNN fp32 11.7 / 11.3 / 15.5, bf16 9.5 / 10.0 / 12.4,
int8 4.2 / 4.2 / 13.2, int4 2.5 / 3.5 / 11.6. torch's kernels take bf16 activations (their
fp32 path is scalar and ~20x slower), so such a matmul casts its input to bf16 and its bf16
output back; the residual stream, norms, attention and the KV cache stay fp32. Where the op
library builds (AVX2 or later), int4 and int8 run our own kernels instead (:func:`quant_kernel`,
``kernels/int4_matmul.py``, ``kernels/int8_matmul.py``): int8 activations per group of 32, as
llama.cpp's Q4 x Q8 and Q8 x Q8, which makes the extra rows of a verify and a prefill cheaper
(docs/engine.md, "Weight formats").

Rules (documented in docs/engine.md, "Weight formats"):
- int4: ``w = (q - 8) * scale + zero`` per group of 32 input columns, q in 0..15 (the layout
  of ``_weight_int4pack_mm_for_cpu``). GGUF Q4_0 blocks map to ``scale = d, zero = 0``; Q4_1
  to ``scale = d, zero = m + 8 d``; the codes are copied. A float weight is quantised per group
  by min/max (``scale = (max - min) / 15``, codes rounded to nearest), Q4_1's rule.
- int8: symmetric per output row, ``scale = max|w| / 127`` (rounded to bf16 first, so the
  codes are rounded against the scale the kernel uses).
- The LM head keeps 8 bits in the int4 format (its GGUF tensor is usually Q8_0, and it is a
  fifth of the model's bytes: 0.6 vs 0.4 ms per token here), and its dense fp32 weight stays
  (vocabulary gathers and tied embeddings read rows of it).
- Scales and zeros are bf16 in torch's kernels (up to 2^-9 relative rounding of each scale),
  float16 in the VNNI one (exact for GGUF's float16 block scales).

Contract: a :class:`QuantLinear` computes ``x @ W_q.T + b`` for ``x`` [..., in] of any float
dtype, returning ``x``'s dtype; row i of the output depends only on row i of the input, but the
kernels may round differently at other row counts, so lossless checks compare a method with
plain decoding through the *same* modules (as for the packed fp32 path). Inference only: the
modules hold no parameters and no autograd graph.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
GROUP = 32  # input columns per int4 scale/zero pair (GGUF's Q4 block size)


def resolve_weights(fmt: str, device: str, dtype: torch.dtype, auto: str = "int4") -> str:
    """``auto`` -> ``auto`` (int4 unless a registered model says otherwise) on a CPU with float32
    activations and the kernel, else fp32; others are checked: the quantised formats run on the
    CPU with float32 activations only."""
    if fmt == "auto":
        return auto if device == "cpu" and dtype == torch.float32 and kernels_available(auto) else "fp32"
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}: use auto or one of {', '.join(WEIGHT_FORMATS)}")
    if fmt != "fp32" and (device != "cpu" or dtype != torch.float32):
        raise ValueError(f"weights {fmt} run on the CPU with float32 activations (got {device}, {dtype})")
    if not kernels_available(fmt):
        raise ValueError(f"this torch build has no CPU kernel for {fmt} weights")
    return fmt


def kernels_available(fmt: str) -> bool:
    """Whether torch has the CPU kernel ``fmt`` needs (fp32 always)."""
    ops = torch.ops.aten
    need = {"int4": "_weight_int4pack_mm_for_cpu", "int8": "_weight_int8pack_mm"}.get(fmt)
    return need is None or hasattr(ops, need)


@dataclass(frozen=True)
class GroupCodes:
    """A [N, K] weight as 4-bit codes in groups of :data:`GROUP` columns: ``(q - 8) * scale + zero``."""

    codes: torch.Tensor  # [N, K] uint8, values 0..15
    scale: torch.Tensor  # [N, K // GROUP] float32
    zero: torch.Tensor  # [N, K // GROUP] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:  # -> [N, K] float32
        n, k = self.shape
        q = self.codes.float().view(n, k // GROUP, GROUP)
        return ((q - 8) * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> GroupCodes:
        """The codes of rows ``index`` ([r] int), e.g. to undo a GGUF row permutation."""
        return GroupCodes(self.codes[index], self.scale[index], self.zero[index])

    @staticmethod
    def from_float(w: torch.Tensor) -> GroupCodes:
        """Quantise ``w`` [N, K] (K a multiple of GROUP) by per-group min/max (Q4_1's rule)."""
        n, k = w.shape
        if k % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
        g = w.detach().float().reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)  # [N, K/G]
        scale = (hi - lo) / 15
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, 15).to(torch.uint8)
        return GroupCodes(q.reshape(n, k), scale, lo + 8 * scale)

    @staticmethod
    def cat(parts: Sequence[GroupCodes]) -> GroupCodes:
        """Stack along the output rows (fused q/k/v, gate/up)."""
        if len(parts) == 1:
            return parts[0]
        return GroupCodes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))


class Int4Matmul:
    """``y = x @ W.T (+ b)``, W stored as packed 4-bit group codes (bf16 scales/zeros).
    ``stream``: the weight is read once a forward (see :func:`quantize_linears`)."""

    stream = False

    def __init__(self, codes: GroupCodes, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        k = codes.shape[1]
        if k % GROUP:
            raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {k}")
        self.in_features, self.sizes = k, list(sizes)
        self.bias = bias
        self.kernel = quant_kernel(codes.shape[0])
        if self.kernel == "vnni":  # int8 activations (kernels/int4_matmul.py)
            from evospec.kernels.int4_matmul import pack_int4

            self.packed = pack_int4(codes.codes, codes.scale, codes.zero - 8 * codes.scale)
            return
        # The packed layout depends on this CPU's instruction set: always pack where it runs.
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes.to(torch.int32), 1)
        sz = torch.stack([codes.scale, codes.zero], dim=-1)  # [N, K/G, 2]
        self.scales_zeros = sz.transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/G, N, 2]

    @property
    def nbytes(self) -> int:
        if self.kernel == "vnni":
            return self.packed.nbytes  # scales and zeros inside
        return self.packed.nbytes + self.scales_zeros.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        return _finish(self.rows(_flat_input(x, self.in_features, self.kernel)), x, self.bias)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The bias-free product of rows x [M, K] (bf16; the VNNI kernel also takes float32) ->
        [M, N] in x's dtype, with no reshape or cast around the kernel (``fused.py`` calls it
        directly: each of those is a node a recorded step replays)."""
        if self.kernel == "vnni":
            return torch.ops.evospec.int4_matmul(x, self.packed, self.stream)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)


QUANT_KERNEL_ENV = "EVOSPEC_QUANT_KERNEL"  # "torch" | "vnni" | unset (auto)


def quant_kernel(out_features: int) -> str:
    """Which kernel an int4 or int8 linear runs: ``vnni`` (int8 activations,
    ``kernels/int4_matmul.py``, ``kernels/int8_matmul.py``; AVX-512 VNNI, AVX-VNNI or AVX2, the
    same bits on each) where the op library loads and N is a multiple of 16, else ``torch``
    (bf16 activations).
    ``EVOSPEC_QUANT_KERNEL=torch`` keeps torch's everywhere."""
    choice = os.environ.get(QUANT_KERNEL_ENV, "auto")
    if choice not in ("auto", "torch", "vnni"):
        raise ValueError(f"{QUANT_KERNEL_ENV}={choice!r}: use torch, vnni or leave it unset")
    if choice == "torch" or out_features % 16:
        return "torch"
    from evospec.kernels.int4_matmul import vnni_available

    if vnni_available():
        return "vnni"
    if choice == "vnni":
        raise ValueError(f"{QUANT_KERNEL_ENV}=vnni: this CPU or build has no int8-activation kernels (AVX2+)")
    return "torch"


# rows quantised at a time: an LM head's float temporaries stay a few MB (Gemma-3-270M's whole
# 262,144-row head at once made ~2 GB of them at load)
_ROWS_AT_ONCE = 8192


class Int8Matmul:
    """``y = x @ W.T (+ b)``, W stored as int8 with one bf16 scale per output row.

    With the VNNI kernel the weight lives only in its tiles (``kernels/int8_matmul.py``: int8
    activations, float32 logits without a bf16 round trip); :meth:`weight_rows` reads rows of
    codes back from them for the vocabulary heads that gather some (``vocab/head.py``), and
    ``codes`` [N, K] builds the whole row-major table when asked (tests). Elsewhere ``codes``
    is torch's kernel's own operand. ``scale`` [N] stays row-major. ``stream``: as
    :class:`Int4Matmul`'s. (Until wave 47 the row-major codes were kept beside the tiles: every
    int8 weight twice, Gemma-3-270M's LM head alone 168 MB more.)
    """

    stream = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        w = weight.detach()  # [N, K]
        scale = torch.empty(w.shape[0], dtype=torch.bfloat16, device=w.device)  # [N]
        codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)  # [N, K]
        for start in range(0, w.shape[0], _ROWS_AT_ONCE):  # rows are independent: the same codes
            rows = w[start : start + _ROWS_AT_ONCE].float()
            s = (rows.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
            codes[start : start + _ROWS_AT_ONCE] = (rows / s.float()[:, None]).round().clamp(-127, 127)
            scale[start : start + _ROWS_AT_ONCE] = s
        self.scale = scale
        self.shape = tuple(w.shape)  # (N, K)
        self.in_features, self.sizes = w.shape[1], list(sizes)
        self.bias = bias
        self.kernel = quant_kernel(w.shape[0]) if w.shape[1] % GROUP == 0 else "torch"
        self._codes: torch.Tensor | None = codes  # row-major: torch's kernel's operand
        if self.kernel == "vnni":
            from evospec.kernels.int8_matmul import pack_int8

            self.packed = pack_int8(codes)  # [N/16, K/32, 512]
            self.scale_f32 = scale.float()  # [N] the same values
            self._codes = None  # the tiles hold them

    @property
    def codes(self) -> torch.Tensor:
        """[N, K] int8 row-major (built from the tiles where only they are kept)."""
        if self._codes is not None:
            return self._codes
        from evospec.kernels.int8_matmul import unpack_int8

        return unpack_int8(self.packed)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[a] output rows -> their int8 codes [a, K] (from the tiles, or the row-major table)."""
        if self._codes is not None:
            return self._codes.index_select(0, ids)
        from evospec.kernels.int8_matmul import read_int8_rows

        return read_int8_rows(self.packed, ids)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: its codes and scales."""
        return self.shape[0] * self.shape[1] + self.scale.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _finish(self.rows(_flat_input(x, self.in_features, self.kernel)), x, self.bias)

    def rows(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]: see Int4Matmul.rows
        if self.kernel == "vnni":
            return torch.ops.evospec.int8_matmul(x, self.packed, self.scale_f32, self.stream)
        return torch.ops.aten._weight_int8pack_mm(x, self._codes, self.scale)


class Bf16Matmul:
    """``y = x @ W.T (+ b)`` with W in bf16 (inputs cast to bf16, outputs back)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int]) -> None:
        self.weight = weight.detach().to(torch.bfloat16).contiguous()
        self.in_features, self.sizes = weight.shape[1], list(sizes)
        self.bias = bias

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _finish(self.rows(_flat_input(x, self.in_features, "torch")), x, self.bias)

    def rows(self, x: torch.Tensor) -> torch.Tensor:  # bf16 [M, K] -> bf16 [M, N]: see Int4Matmul.rows
        return F.linear(x, self.weight)


QuantMatmul = Int4Matmul | Int8Matmul | Bf16Matmul


def _flat_input(x: torch.Tensor, k: int, kernel: str) -> torch.Tensor:
    """x [..., K] as the rows a product takes: bf16 for torch's kernels, float32 or bf16 as
    given for ours (their int8 activations are quantised from either)."""
    flat = x.reshape(-1, k)
    if kernel != "vnni":
        return flat.to(torch.bfloat16)
    return flat if flat.dtype in (torch.float32, torch.bfloat16) else flat.float()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
    return y if bias is None else y + bias.to(y.dtype)


class QuantLinear(nn.Module):
    """Drop-in for a frozen ``nn.Linear`` whose product runs through a quantised matmul.

    A member of a fused group shares the group's matmul and returns its slice of the
    output (the module's own forward is used only by callers outside the fused path).
    ``weight`` is kept only where others read rows of it (the LM head); elsewhere it is
    None and the dense weight is freed. A head tied to a compact embedding (:meth:`tie`,
    ``embedding.py``) answers ``weight`` with that module's float table, built on first use.
    """

    def __init__(
        self,
        matmul: QuantMatmul,
        out_slice: slice,
        fmt: str,
        weight: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.matmul = matmul
        self.out_slice = out_slice
        self.in_features = matmul.in_features
        self.out_features = out_slice.stop - out_slice.start
        self.format = fmt
        # plain attributes (not a Parameter): the dense weight, tied to the embedding when shared,
        # or the compact embedding that holds it (:meth:`tie`; a list: not a submodule)
        self._weight = weight
        self._tied: list[nn.Module] = []
        self.bias = None

    @property
    def weight(self) -> torch.Tensor | None:
        return self._tied[0].weight if self._tied else self._weight

    def tie(self, embedding: nn.Module) -> None:
        """Read ``weight`` from ``embedding`` (a ``CompactEmbedding`` that replaced the table this
        head was tied to) and let the dense one go."""
        self._tied, self._weight = [embedding], None

    def __dir__(self):
        # as CompactEmbedding's: a tied head's weight is built when read, and the tracer reads all
        return [name for name in super().__dir__() if name != "weight" or not self._tied]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        whole = self.out_slice.start == 0 and self.out_slice.stop == y.shape[-1]
        return y if whole else y[..., self.out_slice]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.format}"


@dataclass
class QuantReport:
    """What :func:`quantize_linears` did: linears swapped, how many int4 weights came from the
    checkpoint's own 4-bit codes and how many were rounded to 4 bits from its floats (a GGUF's
    5-, 6- or 8-bit tensors among them), and the bytes the quantised weights occupy."""

    linears: int = 0
    from_codes: int = 0
    requantised: int = 0
    nbytes: int = 0


def quantize_linears(
    model: nn.Module,
    fmt: str,
    codes: Mapping[str, GroupCodes] | None = None,
    *,
    keep_dense: Sequence[str] = ("lm_head",),
    head_format: Mapping[str, str] | None = None,
    stream: bool = False,
) -> QuantReport:
    """Swap ``model``'s ``nn.Linear`` modules for :class:`QuantLinear` in format ``fmt``.

    ``codes`` maps a weight's parameter name (``layers.0.self_attn.q_proj.weight``) to its
    4-bit codes from the checkpoint (used as they are in the int4 format); other weights are
    quantised by this module's rules. Linears named in ``keep_dense`` keep their dense weight;
    ``head_format`` overrides the format per linear name (default: the LM head takes int8 when
    ``fmt`` is int4). A linear whose in_features the int4 kernel cannot take keeps its
    ``nn.Linear``. Call on a fully loaded model, before any packing.

    ``stream``: the model's weights are read once a forward, as a target model's are (a SmolLM2
    int4 step reads ~94 MB, three times this CPU's L3): our kernels then prefetch them
    non-temporally, so that they do not evict from the caches what is read again -- the KV
    cache, a draft's weights (``stream`` False: a draft reads its few MB again every round).
    Plain decoding 1.03-1.06x on a 2-core Zen 4, the speculative methods 1.00-1.03x, nothing
    on a quiet host (docs/benchmarks.md, wave 40). No effect on any result.
    """
    if fmt not in WEIGHT_FORMATS or fmt == "fp32":
        raise ValueError(f"quantize_linears takes one of {WEIGHT_FORMATS[1:]}, got {fmt!r}")
    if not kernels_available(fmt):
        raise ValueError(f"this torch build has no CPU kernel for {fmt} weights")
    codes = codes or {}
    overrides = dict(head_format or ({"lm_head": "int8"} if fmt == "int4" else {}))
    report = QuantReport()
    names = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad():
        for module in list(model.modules()):
            groups = [tuple(g) for g in getattr(module, "FUSED", {}).values()]
            fused_attrs = dict(zip(groups, getattr(module, "FUSED", {}), strict=False))
            done: set[str] = set()
            for group in groups:
                parts = [getattr(module, c) for c in group]
                if all(type(p) is nn.Linear for p in parts):
                    prefix = names[id(module)]
                    named = [_join(prefix, c) for c in group]
                    matmul = _make_matmul(parts, named, fmt, codes, report, stream)
                    if matmul is None:
                        continue
                    setattr(module, fused_attrs[group], matmul)
                    start = 0
                    for child, part in zip(group, parts, strict=True):
                        stop = start + part.out_features
                        setattr(module, child, QuantLinear(matmul, slice(start, stop), fmt))
                        start = stop
                    done.update(group)
            for name, child in list(module.named_children()):
                if type(child) is not nn.Linear or name in done:
                    continue
                full = _join(names[id(module)], name)
                child_fmt = overrides.get(full, fmt)
                matmul = _make_matmul([child], [full], child_fmt, codes, report, stream)
                if matmul is not None:
                    dense = child.weight if full in keep_dense else None
                    setattr(module, name, QuantLinear(matmul, slice(0, child.out_features), child_fmt, dense))
    return report


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _make_matmul(
    parts: Sequence[nn.Linear],
    names: Sequence[str],
    fmt: str,
    codes: Mapping[str, GroupCodes],
    report: QuantReport,
    stream: bool = False,
) -> QuantMatmul | None:
    sizes = [p.out_features for p in parts]
    biases = [p.bias for p in parts]
    bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases])
    if fmt == "int4":
        if parts[0].in_features % GROUP:
            return None
        given = [codes.get(f"{n}.weight") for n in names]
        report.from_codes += sum(c is not None for c in given)
        report.requantised += sum(c is None for c in given)
        group = [
            c if c is not None else GroupCodes.from_float(p.weight) for c, p in zip(given, parts, strict=True)
        ]
        matmul: QuantMatmul = Int4Matmul(GroupCodes.cat(group), bias, sizes)
    else:
        weight = torch.cat([p.weight.detach() for p in parts]) if len(parts) > 1 else parts[0].weight
        matmul = (Int8Matmul if fmt == "int8" else Bf16Matmul)(weight, bias, sizes)
    if not isinstance(matmul, Bf16Matmul):
        matmul.stream = stream
    report.linears += len(parts)
    report.nbytes += matmul.nbytes
    return matmul

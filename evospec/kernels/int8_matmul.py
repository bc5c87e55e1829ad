"""The int8 x int8 matmul (``int8_matmul.cpp``): weight packing and its torch reference.

Owns: :func:`pack_int8` (symmetric int8 row codes -> the kernel's tile layout),
:func:`write_int8_rows` (a few rows of that layout rewritten in place),
:func:`unpack_int8`, :func:`int8_matmul` (the op) and :func:`int8_matmul_ref` (the same
arithmetic in plain torch, bit for bit: tests hold the kernel to it). Knows tensors only;
``models/quant.py`` decides where it is used (the int8 LM head), and availability is the int4
kernel's (:func:`~evospec.kernels.int4_matmul.vnni_available`: one library, one build flag).

Weights ``w = code * scale[n]`` (code in -127..127, one scale per output row, as
``quant.Int8Matmul`` stores them); activations are int8 per row and group of 32 as for the
int4 kernel (:func:`~evospec.kernels.int4_matmul.quantize_activations`).
"""

from __future__ import annotations

import torch

from evospec.kernels.int4_matmul import GROUP, TILE, quantize_activations

BLOCK = TILE * GROUP  # bytes per tile group


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` int8 [N, K] (-127..127; N % 16 == 0, K % 32 == 0) -> uint8 [N/16, K/32, 512]:
    per tile of 16 outputs and group of 32 inputs, 8 blocks of 4 inputs x 16 outputs, each code
    plus 128 (``vpdpbusd`` multiplies unsigned by signed bytes)."""
    n, k = codes.shape
    if n % TILE or k % GROUP:
        raise ValueError(f"int8_matmul needs N % {TILE} == 0 and K % {GROUP} == 0, got [{n}, {k}]")
    if codes.dtype != torch.int8 or int(codes.min()) < -127:
        raise ValueError("int8_matmul packs symmetric int8 codes in -127..127")
    u = (codes.to(torch.int16) + 128).to(torch.uint8)  # [N, K] in 1..255
    u = u.view(n // TILE, TILE, k // GROUP, 8, 4).permute(0, 2, 3, 1, 4)  # [T, g, block, lane, i]
    return u.reshape(n // TILE, k // GROUP, BLOCK).contiguous()


def write_int8_rows(packed: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor) -> None:
    """Overwrite output rows ``rows`` [a] of a :func:`pack_int8` layout in place with ``codes``
    int8 [a, K]: one lane of a tile per row, so a few rows change without repacking the rest
    (the vocabulary heads' slots, ``vocab/head.py``)."""
    t, g, _ = packed.shape
    lanes = (codes.to(torch.int16) + 128).to(torch.uint8).view(-1, g, 8, 4)  # [a, g, block, i]
    packed.view(t, g, 8, TILE, 4)[rows // TILE, :, :, rows % TILE, :] = lanes


def read_int8_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Output rows ``rows`` [a] of a :func:`pack_int8` layout as int8 codes [a, K]: the inverse
    of :func:`write_int8_rows`, one lane of a tile per row (the vocabulary heads' gathers):
    through the op ``int8_rows`` where the library is built (12,288 of SmolLM2's rows in ~1 ms
    against ~14 ms for the strided indexing below)."""
    if packed.device.type == "cpu" and hasattr(torch.ops.evospec, "int8_rows"):
        return torch.ops.evospec.int8_rows(packed, rows)
    return read_int8_rows_ref(packed, rows)


def read_int8_rows_ref(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`read_int8_rows` in torch ops (the op's reference)."""
    t, g, _ = packed.shape
    lanes = packed.view(t, g, 8, TILE, 4)[rows // TILE, :, :, rows % TILE, :]  # [a, g, block, i]
    return (lanes.reshape(-1, g * GROUP).to(torch.int16) - 128).to(torch.int8)


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int8`: codes int8 [N, K]."""
    t, g, _ = packed.shape
    u = packed.view(t, g, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(t * TILE, g * GROUP)
    return (u.to(torch.int16) - 128).to(torch.int8)


def int8_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, stream: bool = False
) -> torch.Tensor:
    """``x`` [M, K] float32 or bfloat16, ``scale`` float32 [N] -> [M, N] in ``x``'s dtype;
    ``stream`` as :func:`~evospec.kernels.int4_matmul.int4_matmul`'s."""
    return torch.ops.evospec.int8_matmul(x, packed, scale, stream)


def int8_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: the same bits (float32 adds in group order)."""
    codes = unpack_int8(packed).double()  # [N, K]
    n, k = codes.shape
    g = k // GROUP
    c, a, _ = quantize_activations(x)
    dots = torch.einsum("mgk,ngk->mng", c.view(-1, g, GROUP).double(), codes.view(n, g, GROUP))  # exact
    dots = dots.float()
    acc = torch.zeros(x.shape[0], n)
    for i in range(g):
        acc = acc + a[:, i : i + 1] * dots[:, :, i]
    return (acc * scale).to(x.dtype)

"""The int4 x int8 matmul (``int4_matmul.cpp``): weight packing, availability, torch reference.

Owns: :func:`vnni_available` (the op library is loaded and has the int8-activation kernels),
:func:`kernel_isa` (which instruction set they use),
:func:`pack_int4` (4-bit group codes -> the kernel's tile layout), :func:`int4_matmul`
(the op) and :func:`int4_matmul_ref` (the same arithmetic in plain torch, bit for bit: tests
hold the kernel to it). Knows tensors only; ``models/quant.py`` decides where it is used.

Weights ``w = q * scale + zero`` (q in 0..15, groups of 32 input columns); each activation
row's group of 32 is quantised to int8 by its own scale ``max|x| / 127``, as llama.cpp does
for Q4 x Q8 dot products. On two Zen 4 cores an extra row of a SmolLM2 verify forward costs
the kernel a fraction of torch's bf16 int4 kernel (``scripts/bench_linear.py --formats``).
"""

from __future__ import annotations

import functools

import torch

GROUP = 32  # input columns per weight scale/zero and per activation scale
TILE = 16  # output columns per tile


@functools.cache
def vnni_available() -> bool:
    """Whether the op library is loaded and has the int8-activation kernels (built for AVX-512
    VNNI, AVX-VNNI or AVX2: :func:`kernel_isa` says which)."""
    from evospec.kernels.cpu_ops import load_cpu_ops

    return load_cpu_ops() and bool(torch.ops.evospec.int4_vnni())


def kernel_isa() -> str:
    """The instruction set of the int8-activation kernels: ``avx512-vnni``, ``avx-vnni`` or
    ``avx2`` (the same bits on each, ``kernels/vnni.h``); ``none`` without them."""
    return str(torch.ops.evospec.int4_isa()) if vnni_available() else "none"


def block_rows() -> int:
    """The activation rows our kernels take in one pass over a weight tile: 8 where they are
    built for AVX-512 (32 zmm registers), 4 elsewhere; past it a forward reads each tile again.
    1 without the kernels."""
    return int(torch.ops.evospec.int4_block_rows()) if vnni_available() else 1


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes`` [N, K] (0..15), ``scale``/``zero`` [N, K/32] (``w = q * scale + zero``) ->
    packed uint8 [N/16, K/32, 320] (N % 16 == 0): per tile of 16 outputs and group of 32 inputs,
    256 bytes of codes then the 16 scales and 16 zeros as float16 (GGUF stores its Q4 block
    scales in float16: exact for them), so a thread reads one contiguous stream."""
    n, k = codes.shape
    if n % TILE or k % GROUP:
        raise ValueError(f"int4_matmul needs N % {TILE} == 0 and K % {GROUP} == 0, got [{n}, {k}]")
    g = k // GROUP
    q = codes.to(torch.uint8).view(n // TILE, TILE, g, 4, 2, 4)  # [T, lane, g, block, half, j]
    q = q.permute(0, 2, 3, 1, 5, 4)  # [T, g, block, lane, j, half]
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(n // TILE, g, 256)

    def tiles(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [T, G, 32] bytes (16 float16)
        half = t.float().view(n // TILE, TILE, g).transpose(1, 2).to(torch.float16)
        return half.contiguous().view(torch.uint8)

    return torch.cat([nibbles, tiles(scale), tiles(zero)], dim=-1).contiguous()


def unpack_int4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_int4`: codes [N, K] int32, scale and zero [N, K/32] float32."""
    t, g, _ = packed.shape
    nibbles = packed[..., :256]
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=-1).view(t, g, 4, TILE, 4, 2)  # T g b lane j half
    codes = q.permute(0, 3, 1, 2, 5, 4).reshape(t * TILE, g * GROUP).to(torch.int32)

    def rows(b: torch.Tensor) -> torch.Tensor:  # [T, G, 32] bytes -> [N, G]
        return b.contiguous().view(torch.float16).float().transpose(1, 2).reshape(t * TILE, g)

    return codes, rows(packed[..., 256:288]), rows(packed[..., 288:320])


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, stream: bool = False) -> torch.Tensor:
    """``x`` [M, K] float32 or bfloat16 -> [M, N] in ``x``'s dtype (the compiled op). ``stream``:
    the weight is read once a forward, so it is prefetched non-temporally (the same result)."""
    return torch.ops.evospec.int4_matmul(x, packed, stream)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row and group of 32: (int8 codes [M, K] as int32, scale [M, G], code sum [M, G])."""
    m, k = x.shape
    xg = x.float().view(m, k // GROUP, GROUP)
    amax = xg.abs().amax(-1)  # [M, G]
    full = torch.full_like(amax, 127.0)  # true divisions, as the kernel's (127.0 / t is t.reciprocal() * 127)
    inv = torch.where(amax > 0, full / amax, torch.zeros_like(amax))
    c = (xg * inv[..., None]).round().clamp(-128, 127).to(torch.int32)
    return c.view(m, k), amax / full, c.sum(-1).float()


def int4_matmul_ref(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in torch ops: the same bits (float32 adds in group order)."""
    codes, ws, wz = unpack_int4(packed)  # [N, K], [N, G], [N, G]
    n, g = ws.shape
    c, a, s = quantize_activations(x)
    dots = torch.einsum("mgk,ngk->mng", c.view(-1, g, GROUP).double(), codes.view(n, g, GROUP).double())
    dots = dots.float()  # exact: |sum| < 2^24
    acc = torch.zeros(x.shape[0], n)
    for i in range(g):
        term = ws[:, i] * dots[:, :, i] + wz[:, i] * s[:, i : i + 1]
        acc = acc + a[:, i : i + 1] * term
    return acc.to(x.dtype)

"""The int4 x int8 VNNI matmul: its packing, its bits against the torch reference, row
exactness (what keeps verified chains equal to one-token steps), and clear errors."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.int4_matmul import (
    GROUP,
    int4_matmul,
    int4_matmul_ref,
    pack_int4,
    quantize_activations,
    unpack_int4,
    vnni_available,
)
from evospec.models.quant import QUANT_KERNEL_ENV, GroupCodes, Int4Matmul, quant_kernel

needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no int4 kernel (needs AVX2) here")


def _weight(
    n: int, k: int, seed: int = 0
) -> tuple[GroupCodes, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    codes = GroupCodes.from_float(torch.randn(n, k, generator=g))
    return codes, pack_int4(codes.codes, codes.scale, codes.zero - 8 * codes.scale)


def test_packing_keeps_every_code_scale_and_zero():
    codes, packed = _weight(48, 96)
    assert packed.shape == (3, 3, 320) and packed.dtype == torch.uint8
    q, scale, zero = unpack_int4(packed)
    assert torch.equal(q, codes.codes.to(torch.int32))
    assert torch.equal(scale, codes.scale.half().float())  # float16 scales and zeros
    assert torch.equal(zero, (codes.zero - 8 * codes.scale).half().float())
    # one-hot activations: the reference returns the dequantised weight
    w = int4_matmul_ref(torch.eye(96), packed).T  # [N, K]
    assert torch.allclose(w, codes.dequantize(), rtol=2e-3, atol=2e-3)


def test_activation_codes_use_each_groups_own_scale():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-2.0, 1.0, 32)
    x[1, 40] = 5.0
    c, scale, total = quantize_activations(x)
    assert c[0, 0] == -127 and c[0, 31] == round(127 / 2) and c[0, 32:].abs().sum() == 0
    assert scale[0, 0] == pytest.approx(2.0 / 127) and scale[0, 1] == 0 and scale[1, 0] == 0
    assert c[1, 40] == 127 and total[1, 1] == 127


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_the_kernel_gives_the_references_bits(m, dtype):
    _, w = _weight(80, 192, seed=m)
    x = (torch.randn(m, 192) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    x[0, :GROUP] = 0  # an all-zero group: scale 0, no division by zero
    y = int4_matmul(x, w)
    assert y.dtype == dtype and y.shape == (m, 80)
    assert torch.equal(y, int4_matmul_ref(x, w))


@needs_vnni
def test_each_row_gets_the_bits_it_gets_alone():
    _, w = _weight(64, 128, seed=3)
    x = torch.randn(7, 128)
    together = int4_matmul(x, w)
    alone = torch.cat([int4_matmul(x[i : i + 1], w) for i in range(7)])
    assert torch.equal(together, alone)


@needs_vnni
@pytest.mark.parametrize("m", [1, 5, 9])
def test_a_streamed_weight_gives_the_same_bits(m):
    _, w = _weight(64, 128, seed=m)
    x = torch.randn(m, 128).bfloat16()
    assert torch.equal(int4_matmul(x, w, stream=True), int4_matmul(x, w))
    assert torch.equal(int4_matmul(x, w, stream=True), int4_matmul_ref(x, w))


@needs_vnni
def test_the_product_is_close_to_the_dense_one():
    codes, w = _weight(96, 256, seed=5)
    x = torch.randn(4, 256)
    dense = x @ codes.dequantize().T
    err = (int4_matmul(x, w) - dense).abs().max() / dense.abs().max()
    assert err < 0.02  # int8 activations: ~0.5% here


@needs_vnni
def test_bad_inputs_are_clear_errors():
    _, packed = _weight(32, 64)
    with pytest.raises(RuntimeError, match="columns"):
        int4_matmul(torch.randn(2, 96), packed)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int4_matmul(torch.randn(2, 64).double(), packed)
    with pytest.raises(RuntimeError, match="320"):
        int4_matmul(torch.randn(2, 64), packed[..., :256])
    with pytest.raises(ValueError, match="N % 16"):
        pack_int4(torch.zeros(24, 64, dtype=torch.uint8), torch.ones(24, 2), torch.zeros(24, 2))


def test_the_kernel_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv(QUANT_KERNEL_ENV, "torch")
    assert quant_kernel(64) == "torch"
    monkeypatch.setenv(QUANT_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="torch, vnni"):
        quant_kernel(64)
    monkeypatch.delenv(QUANT_KERNEL_ENV)
    assert quant_kernel(24) == "torch"  # not a whole number of tiles
    assert quant_kernel(64) == ("vnni" if vnni_available() else "torch")


@needs_vnni
def test_a_quantised_linear_runs_the_kernel_with_its_bias(monkeypatch):
    monkeypatch.delenv(QUANT_KERNEL_ENV, raising=False)
    codes, w = _weight(32, 64, seed=7)
    bias = torch.randn(32)
    mm = Int4Matmul(codes, bias, [32])
    assert mm.kernel == "vnni"
    x = torch.randn(2, 3, 64)
    y = mm(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.float32
    assert torch.equal(y, int4_matmul(x.view(6, 64), w).view(2, 3, 32) + bias)

"""The int8 x int8 VNNI matmul (the int8 LM head): its packing, its bits against the torch
reference, row exactness, the quantised linear that runs it, and clear errors."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.int4_matmul import GROUP, vnni_available
from evospec.kernels.int8_matmul import (
    int8_matmul,
    int8_matmul_ref,
    pack_int8,
    read_int8_rows,
    read_int8_rows_ref,
    unpack_int8,
    write_int8_rows,
)
from evospec.models.quant import QUANT_KERNEL_ENV, Int8Matmul

needs_vnni = pytest.mark.skipif(not vnni_available(), reason="no int8 kernel (needs AVX2) here")


def _weight(n: int, k: int, seed: int = 0) -> Int8Matmul:
    g = torch.Generator().manual_seed(seed)
    return Int8Matmul(torch.randn(n, k, generator=g), None, [n])


def test_packing_keeps_every_code():
    mm = _weight(48, 96)
    packed = pack_int8(mm.codes)
    assert packed.shape == (3, 3, 512) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int8(packed), mm.codes)
    assert int(packed.min()) >= 1  # codes + 128: the symmetric range never reaches 0
    # one-hot activations: the reference returns the dequantised weight
    w = int8_matmul_ref(torch.eye(96), packed, mm.scale.float()).T  # [N, K]
    assert torch.allclose(w, mm.codes.float() * mm.scale.float()[:, None], rtol=1e-2, atol=1e-2)


def test_packing_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="N % 16"):
        pack_int8(torch.zeros(24, 64, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"-127\.\.127"):
        pack_int8(torch.full((16, 64), -128, dtype=torch.int8))


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_the_kernel_gives_the_references_bits(m, dtype):
    mm = _weight(80, 192, seed=m)
    x = (torch.randn(m, 192) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    x[0, :GROUP] = 0  # an all-zero group: scale 0, no division by zero
    y = int8_matmul(x, mm.packed, mm.scale_f32)
    assert y.dtype == dtype and y.shape == (m, 80)
    assert torch.equal(y, int8_matmul_ref(x, mm.packed, mm.scale_f32))


@needs_vnni
def test_each_row_gets_the_bits_it_gets_alone():
    mm = _weight(64, 128, seed=3)
    x = torch.randn(7, 128)
    together = int8_matmul(x, mm.packed, mm.scale_f32)
    alone = torch.cat([int8_matmul(x[i : i + 1], mm.packed, mm.scale_f32) for i in range(7)])
    assert torch.equal(together, alone)


@needs_vnni
@pytest.mark.parametrize("m", [1, 5, 9])
def test_a_streamed_weight_gives_the_same_bits(m):
    mm = _weight(64, 128, seed=m)
    x = torch.randn(m, 128)
    streamed = int8_matmul(x, mm.packed, mm.scale_f32, stream=True)
    assert torch.equal(streamed, int8_matmul(x, mm.packed, mm.scale_f32))
    assert torch.equal(streamed, int8_matmul_ref(x, mm.packed, mm.scale_f32))


@needs_vnni
def test_a_quantised_linear_runs_the_kernel_close_to_torchs(monkeypatch):
    monkeypatch.delenv(QUANT_KERNEL_ENV, raising=False)
    mm = _weight(96, 256, seed=5)
    assert mm.kernel == "vnni"
    x = torch.randn(2, 3, 256)
    y = mm(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.float32  # float32 logits, no bf16 round trip
    monkeypatch.setenv(QUANT_KERNEL_ENV, "torch")
    ref = _weight(96, 256, seed=5)
    assert ref.kernel == "torch"
    err = (y - ref(x)).abs().max() / y.abs().max()
    assert 0 < err < 0.02  # int8 vs bf16 activations: different, both close


@needs_vnni
def test_bad_inputs_are_clear_errors():
    mm = _weight(32, 64)
    with pytest.raises(RuntimeError, match="columns"):
        int8_matmul(torch.randn(2, 96), mm.packed, mm.scale_f32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        int8_matmul(torch.randn(2, 64).double(), mm.packed, mm.scale_f32)
    with pytest.raises(RuntimeError, match="512"):
        int8_matmul(torch.randn(2, 64), mm.packed[..., :256], mm.scale_f32)
    with pytest.raises(RuntimeError, match="scale"):
        int8_matmul(torch.randn(2, 64), mm.packed, mm.scale_f32[:16])


def test_rows_rewritten_in_place_equal_a_fresh_packing():
    """write_int8_rows changes exactly the rows it is given: the result is the packing of the
    codes with those rows replaced, whatever tiles and lanes they fall in."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    packed = pack_int8(codes)
    rows = torch.tensor([0, 15, 16, 33, 47])
    new = torch.randint(-127, 128, (5, 64), generator=g, dtype=torch.int8)
    write_int8_rows(packed, rows, new)
    expected = codes.clone()
    expected[rows] = new
    assert torch.equal(packed, pack_int8(expected))


def test_rows_read_back_from_the_tiles_are_the_codes():
    """read_int8_rows gives exactly the rows asked for, in their order, from any tile and lane;
    an Int8Matmul on the tiled kernel keeps no row-major copy and answers its rows from them."""
    g = torch.Generator().manual_seed(6)
    codes = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8)
    rows = torch.tensor([47, 0, 16, 15, 33, 16])
    for read in (read_int8_rows, read_int8_rows_ref):  # the op where it is built, and torch's indexing
        assert torch.equal(read(pack_int8(codes), rows), codes[rows])
        assert read(pack_int8(codes), rows[:0]).shape == (0, 64)
    mm = _weight(48, 96)
    full = mm.codes
    assert torch.equal(mm.weight_rows(rows), full[rows])
    if mm.kernel == "vnni":
        assert mm._codes is None  # the tiles only: no second copy of the weight
    assert mm.nbytes == 48 * 96 + mm.scale.nbytes

"""Row gather: the torch reference by hand, the Triton kernel (interpreted) against it, CUDA."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.gather import gather_rows, gather_rows_torch
from tests.kernels.interp_cases import CASES


def test_reference_copies_rows_into_slots_and_skips_padding() -> None:
    weight = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    buf = torch.full((3, 4), -1.0)
    gather_rows_torch(weight, buf, torch.tensor([7, -1, 2]), torch.tensor([2, 1, 0]))
    assert buf[2].tolist() == [28.0, 29.0, 30.0, 31.0]
    assert buf[0].tolist() == [8.0, 9.0, 10.0, 11.0]
    assert buf[1].tolist() == [-1.0] * 4  # the padding entry's slot is untouched


def test_dispatch_on_cpu_is_the_reference_and_checks_shapes() -> None:
    weight = torch.randn(20, 6)
    buf = torch.zeros(5, 6)
    gather_rows(weight, buf, torch.tensor([4, 19]), torch.tensor([3, 0]))
    assert torch.equal(buf[3], weight[4]) and torch.equal(buf[0], weight[19])
    assert not buf[1].any()
    gather_rows(weight, buf, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError):
        gather_rows(weight, torch.zeros(5, 7), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError):
        gather_rows(weight, buf, torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError):
        gather_rows(weight, buf.double(), torch.tensor([1]), torch.tensor([0]))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("gather")])
def test_interpreted_kernel_equals_reference(interpreted: dict[str, str], name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compiled_kernel_equals_reference_on_cuda(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(5000, 1000, device="cuda", generator=gen).to(dtype)
    buf = torch.randn(700, 1000, device="cuda", generator=gen).to(dtype)
    ids = torch.randperm(5000, device="cuda", generator=gen)[:700]
    slots = torch.randperm(700, device="cuda", generator=gen)
    ids[::3] = -1
    got, ref = buf.clone(), buf.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gather_rows(weight, got, ids, slots, backend="triton")  # padded: must not sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gather_rows_torch(weight, ref, ids, slots)
    assert torch.equal(got, ref)

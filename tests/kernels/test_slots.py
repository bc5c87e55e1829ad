"""Fixed-shape slot planning equals the reduced head's host path, and the staged head path
(plan + gather, inline on a CPU) leaves the head bit-identical to ``set_active``."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.slots import FREE, apply_swap, plan_swap
from evospec.vocab.head import ReducedHead


def _masks(seed: int, vocab: int, cap: int, rounds: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rounds):
        n = int(torch.randint(0, cap + 1, (1,), generator=gen))
        m = torch.zeros(vocab, dtype=torch.bool)
        m[torch.randperm(vocab, generator=gen)[:n]] = True
        out.append(m)
    return out


def _same_head(a: ReducedHead, b: ReducedHead) -> None:
    assert torch.equal(a.slot_ids, b.slot_ids)
    assert torch.equal(a.slot_of, b.slot_of)
    assert torch.equal(a.bias, b.bias)
    assert torch.equal(a.rows, b.rows)
    assert a.size == b.size


def test_plan_by_hand() -> None:
    slot_ids = torch.tensor([4, FREE, 2, 7])  # 4 ids over a capacity of 4
    slot_of = torch.full((10,), FREE)
    slot_of[[4, 2, 7]] = torch.tensor([0, 2, 3])
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 9, 1]] = True  # 4 and 7 leave; 1 and 9 enter
    plan = plan_swap(mask, slot_of, slot_ids)
    assert plan.drop_slots.tolist() == [True, False, False, True]
    assert plan.add_ids.tolist() == [1, 9, FREE, FREE]
    assert plan.add_slots.tolist() == [0, 1, FREE, FREE]  # lowest free slots, ascending
    bias = torch.zeros(4)
    apply_swap(plan, slot_of, slot_ids, bias)
    assert slot_ids.tolist() == [1, 9, 2, FREE]
    assert slot_of[[1, 9, 2, 4, 7]].tolist() == [0, 1, 2, FREE, FREE]
    assert bias.tolist() == [0.0, 0.0, 0.0, float("-inf")]


@pytest.mark.parametrize("seed", range(3))
def test_staged_path_equals_host_path(seed: int) -> None:
    vocab, cap, dim = 40, 12, 5
    weight = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed))
    host, staged = ReducedHead(weight, cap), ReducedHead(weight, cap)
    hidden = torch.randn(3, dim)
    for mask in _masks(seed, vocab, cap, 25):
        assert staged.stage(mask) == host.set_active(mask)
        _same_head(host, staged)
        if host.size:
            (lp_a, id_a), (lp_b, id_b) = host(hidden, 4), staged(hidden, 4)
            assert torch.equal(id_a, id_b) and torch.equal(lp_a, lp_b)
    assert host.take_timings().rows_gathered == staged.take_timings().rows_gathered


def test_staging_over_capacity_changes_nothing() -> None:
    head = ReducedHead(torch.randn(20, 3), capacity=4)
    head.stage(torch.arange(20) < 3)
    before = head.slot_ids.clone()
    with pytest.raises(ValueError):
        head.stage(torch.arange(20) >= 10)
    assert torch.equal(head.slot_ids, before) and head.size == 3


@pytest.mark.gpu
def test_staged_path_on_cuda_equals_host_path() -> None:
    vocab, cap, dim = 128256, 3072, 256
    weight = torch.randn(vocab, dim, device="cuda", dtype=torch.float16)
    host, staged = ReducedHead(weight, cap), ReducedHead(weight, cap)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[torch.randperm(vocab, generator=gen)[: int(torch.randint(1, cap, (1,), generator=gen))]] = True
        mask = mask.cuda()
        staged.stage(mask)
        host.set_active(mask)
        hidden = torch.randn(4, dim, device="cuda", dtype=torch.float16)
        (lp_a, id_a), (lp_b, id_b) = host(hidden, 8), staged(hidden, 8)  # waits on the copy stream
        assert torch.equal(id_a, id_b) and torch.equal(lp_a, lp_b)
        _same_head(host, staged)

"""Triton kernels against their torch references, run by Triton's CPU interpreter.

Triton decides at import whether it interprets, so these cases run in a subprocess started
with ``TRITON_INTERPRET=1`` (``conftest.py``): ``python -m tests.kernels.interp_cases`` prints
one JSON object, case name -> "ok" or the failure. Every case compares bit for bit; shapes
stay tiny because the interpreter runs each program in numpy.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable

import torch

from evospec.kernels.gather import gather_rows, gather_rows_torch
from evospec.kernels.window import window_push, window_push_torch

CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


def _gather_pair(vocab: int, dim: int, cap: int, ids: list[int], slots: list[int], dtype=torch.float32):
    gen = torch.Generator().manual_seed(vocab * 31 + dim)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype)
    start = torch.randn(cap, dim, generator=gen).to(dtype)
    ids_t, slots_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)
    got, ref = start.clone(), start.clone()
    gather_rows(weight, got, ids_t, slots_t, backend="interpret")
    gather_rows_torch(weight, ref, ids_t, slots_t)
    assert torch.equal(got, ref), "interpreted gather differs from the torch reference"
    return got, start, weight


@case
def gather_dense() -> None:
    got, start, weight = _gather_pair(50, 24, 8, [3, 49, 0, 7], [5, 0, 7, 2])
    assert torch.equal(got[5], weight[3]) and torch.equal(got[0], weight[49])
    assert torch.equal(got[1], start[1]), "an untouched slot changed"


@case
def gather_padding_and_ragged_rows() -> None:
    # width 40 is not a multiple of the block; padding entries point at a slot that must stay
    got, start, _ = _gather_pair(30, 40, 6, [-1, 12, -1, 29], [4, 1, 4, 3])
    assert torch.equal(got[4], start[4]), "a padding entry wrote its slot"


@case
def gather_half_precision_wide_rows() -> None:
    _gather_pair(20, 600, 5, [19, 2, 11], [4, 0, 1], dtype=torch.float16)  # two column blocks


def _window_state(vocab: int, w_max: int) -> list[torch.Tensor]:
    return [
        torch.full((w_max,), -1, dtype=torch.int64),
        torch.zeros(vocab, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int64),
    ]


def _check_pushes(vocab: int, w_max: int, pushes: list[list[int]]) -> None:
    got, ref = _window_state(vocab, w_max), _window_state(vocab, w_max)
    for i, batch in enumerate(pushes):
        ids = torch.tensor(batch, dtype=torch.int64)
        window_push(*got, ids, backend="interpret")
        window_push_torch(*ref, ids)
        for name, a, b in zip(("ring", "counts", "head"), got, ref, strict=True):
            assert torch.equal(a, b), f"push {i} ({batch}): {name} {a.tolist()} != {b.tolist()}"


@case
def window_by_hand() -> None:
    # duplicates inside one push, padding, an exact fill, then eviction of the oldest entries
    _check_pushes(10, 5, [[1, 2, -1, 3], [3, 3], [4, -1, 5, 6], [7], [-1, -1]])
    got = _window_state(10, 5)
    for batch in ([1, 2, -1, 3], [3, 3], [4, -1, 5, 6]):
        window_push(*got, torch.tensor(batch), backend="interpret")
    _, counts, head = got
    assert head.tolist() == [8] and counts.tolist() == [0, 0, 0, 2, 1, 1, 1, 0, 0, 0]


@case
def window_pushes_wider_than_the_window() -> None:
    _check_pushes(12, 4, [[9, 9], [*range(12), 2, -1, 2], [1] * 9, [-1] * 6, [8, 8, 8, 8]])


@case
def window_random_against_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    for vocab, w_max in ((16, 7), (40, 23)):
        pushes = []
        for _ in range(12):
            n = int(torch.randint(0, 3 * w_max, (1,), generator=gen))
            pushes.append(torch.randint(-4, vocab, (n,), generator=gen).tolist())
        _check_pushes(vocab, w_max, pushes)


@case
def window_push_longer_than_a_kernel_block() -> None:
    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(-2, 50, (600,), generator=gen).tolist()  # three loop steps of 256
    _check_pushes(50, 300, [batch[:10], batch, batch[:70]])


def main() -> int:
    out: dict[str, str] = {}
    for name, fn in CASES.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Triton kernels of ``gather.py`` and ``window.py``, in a module of their own: importing
``triton`` costs ~0.13 s and ~65 MB resident, which a CPU process that never launches a Triton
kernel (a CUDA buffer, or ``TRITON_INTERPRET``) should not pay. Their callers import this
module at their first non-torch launch; the contracts live with the callers.
"""

from __future__ import annotations

import triton.language as tl

from evospec.kernels.dispatch import LazyKernel


def _gather_rows_kernel(
    w_ptr,  # [V, D] LM-head rows
    buf_ptr,  # [C, D] packed buffer
    ids_ptr,  # [n] token ids, < 0 = padding
    slots_ptr,  # [n] destination slots
    D,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    tok = tl.load(ids_ptr + i).to(tl.int64)
    if tok >= 0:
        slot = tl.load(slots_ptr + i).to(tl.int64)
        cols = j * BLOCK + tl.arange(0, BLOCK)
        inside = cols < D
        row = tl.load(w_ptr + tok * D + cols, mask=inside)
        tl.store(buf_ptr + slot * D + cols, row, mask=inside)


GATHER = LazyKernel(_gather_rows_kernel)


def _window_push_kernel(
    ids_ptr,  # [n] int64 candidates, < 0 = padding
    n,
    ring_ptr,  # [W] int64
    counts_ptr,  # [V] int32
    head_ptr,  # [1] int64
    w_max,
    BLOCK: tl.constexpr,
):
    # one program: ranks are a running prefix sum over the candidates, in order
    offs0 = tl.arange(0, BLOCK)
    m = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        x = tl.load(ids_ptr + start + offs0, mask=start + offs0 < n, other=-1)
        m += (x >= 0).to(tl.int64)
    total = tl.sum(m, axis=0)  # valid entries in this push
    head = tl.load(head_ptr)
    base = total * 0
    for start in range(0, n, BLOCK):
        x = tl.load(ids_ptr + start + offs0, mask=start + offs0 < n, other=-1).to(tl.int64)
        valid = x >= 0
        v64 = valid.to(tl.int64)
        rank = base + tl.cumsum(v64, axis=0) - 1  # [BLOCK]
        keep = valid & (rank >= total - w_max)
        slot = (head + rank) % w_max
        old = tl.load(ring_ptr + slot, mask=keep, other=-1)
        tl.store(ring_ptr + slot, x, mask=keep)
        tl.atomic_add(counts_ptr + old, tl.full([BLOCK], -1, tl.int32), mask=keep & (old >= 0))
        tl.atomic_add(counts_ptr + x, tl.full([BLOCK], 1, tl.int32), mask=keep)
        base += tl.sum(v64, axis=0)
    tl.store(head_ptr, head + total)


PUSH = LazyKernel(_window_push_kernel)

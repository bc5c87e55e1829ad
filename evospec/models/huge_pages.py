"""A CPU step's big tensors in 2 MB pages, where Linux gives huge pages only on request.

Owns: :func:`thp_mode` (the kernel's transparent-huge-page setting), :func:`huge_zeros` (a zeroed
tensor in a mapping of its own that asks for huge pages), :func:`huge_copy` (a tensor copied into
one) and :func:`adopt_weights` (moves a quantised model's packed weights into one).
``kv_cache.KVCache`` takes its keys and values from :func:`huge_zeros`; the loader calls
:func:`adopt_weights` before the fused ops and the recorded steps take references to the weights,
and so does a draft's quantised copy (``eagle.quantised_head``); a reduced LM head's packed rows
(``vocab/head.py``) are a :func:`huge_copy`: read cold every drafted round.

Why: a one-token SmolLM2 int4 step reads ~95 MB of packed weights (and its keys and values,
~23 KB a cached slot) through 4 KB pages, ~25,000 of them a step: far past what the TLB holds,
so the weight loops also wait on page walks. On a kernel whose THP setting is ``madvise`` (the
usual server default; ``always`` gives huge pages without asking, ``never`` refuses them) memory
from ``malloc`` -- torch's tensors -- stays in 4 KB pages. On the Intel Xeon VM of
docs/benchmarks.md, wave 46, steps at 64-1,000 cached slots ran 3-10% faster with the weights and
the cache in 2 MB pages (the same process, interleaved).

A mapping is anonymous and private (zero-filled; copied on write after a fork, as malloc's
memory), 2 MB larger than asked, its tensor starting at the first 2 MB boundary in it;
``torch.frombuffer`` keeps the mapping alive as long as any view of it. Set
``EVOSPEC_HUGE_PAGES=0`` to keep torch's own allocations (an A/B, or a host that forbids
``madvise``). Nothing here changes a value: the same bytes, elsewhere.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch
from torch import nn

HUGE = 2 << 20  # bytes per huge page (x86-64, arm64 with 4 KB base pages)
MIN_BYTES = 2 << 20  # smaller tensors stay where torch puts them (a draft's caches, tiny models)
THP_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "EVOSPEC_HUGE_PAGES"


def thp_mode(path: Path = THP_FILE) -> str | None:
    """The kernel's THP setting (``always``, ``madvise`` or ``never``: the bracketed word), or
    None where it cannot be read (not Linux, no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def wanted(nbytes: int) -> bool:
    """Whether a CPU tensor of ``nbytes`` goes into a mapping of its own: large enough, not
    switched off, and a kernel that gives huge pages on request."""
    return (
        nbytes >= MIN_BYTES
        and os.environ.get(ENV, "1") != "0"
        and hasattr(mmap, "MADV_HUGEPAGE")
        and thp_mode() in ("always", "madvise")
    )


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zeroed CPU tensor of ``shape``, in 2 MB pages where :func:`wanted` (else, or
    where the kernel refuses the request, a plain ``torch.zeros``)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    arena = _mapping(nbytes) if wanted(nbytes) else None
    if arena is None:
        return torch.zeros(shape, dtype=dtype)
    return arena[:nbytes].view(dtype).view(shape)


def huge_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous, CPU) copied into 2 MB pages where :func:`wanted`, else ``t`` itself."""
    arena = _mapping(t.nbytes) if t.device.type == "cpu" and t.is_contiguous() and wanted(t.nbytes) else None
    if arena is None:
        return t
    return arena[: t.nbytes].view(t.dtype).view(t.shape).copy_(t)


def _mapping(nbytes: int) -> torch.Tensor | None:
    """uint8 [>= nbytes] at a 2 MB boundary of a fresh zeroed mapping that asks for huge pages;
    None where the kernel refuses the mapping or the request."""
    size = -(-nbytes // HUGE) * HUGE + HUGE  # whole huge pages, and room to align
    try:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MB pages
    except OSError:
        return None
    base = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive
    start = -base.data_ptr() % HUGE
    return base[start : start + size - HUGE]


def adopt_weights(model: nn.Module) -> int:
    """Move every ``packed`` weight of ``model``'s quantised matmuls (``quant.Int4Matmul``,
    ``quant.Int8Matmul``: what a step streams) into one huge-page mapping, each at a 4 KB
    boundary, and point the matmuls at the copies. Returns the bytes moved (0 where not
    :func:`wanted`). Call before anything keeps references to the old tensors (fused ops,
    recorded steps)."""
    from evospec.models.quant import Int4Matmul, Int8Matmul

    owners = {}  # one entry per matmul object (q/k/v projections share their fused qkv's)
    for module in model.modules():
        for obj in vars(module).values():
            packed = getattr(obj, "packed", None) if isinstance(obj, (Int4Matmul, Int8Matmul)) else None
            if isinstance(packed, torch.Tensor) and packed.device.type == "cpu" and packed.is_contiguous():
                owners[id(obj)] = obj
    slots = [-(-o.packed.nbytes // 4096) * 4096 for o in owners.values()]
    total = sum(slots)
    arena = _mapping(total) if owners and wanted(total) else None
    if arena is None:
        return 0
    at = 0
    for obj, slot in zip(owners.values(), slots, strict=True):
        old = obj.packed
        copy = arena[at : at + old.nbytes].view(old.dtype).view(old.shape)
        copy.copy_(old)
        obj.packed = copy
        at += slot
    return total

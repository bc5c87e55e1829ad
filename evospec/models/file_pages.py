"""The checkpoint's pages a loaded model no longer reads, handed back to the kernel.

Owns: :func:`mapped_weights` (what quantisation may drop, noted before it runs) and
:func:`release_dropped` (gives back the pages of those that the model no longer holds). Knows
tensors, modules and Linux page mappings only.

Why: ``safetensors`` maps a checkpoint file and its tensors are views into that mapping. A
model keeps some of them (its norms), which keeps the whole mapping, and so every page that
quantisation read stays resident after the float weights it held are gone: file-backed and
clean, but counted in the process's memory until the kernel is short of it. Gemma-3-270M
(int8 weights, all quantised from its 1.07 GB float32 cache) kept 1.14 GB of such pages;
SmolLM2-135M the 108 MB of its float embedding (its linears come from the GGUF's 4-bit codes,
but the int8 LM head and the compact embedding read that table). ``madvise(MADV_DONTNEED)`` on
a file mapping drops this process's pages and nothing else: a page touched again is read back
from the file (the page cache keeps it while memory allows), so no value can change; pages of
anonymous memory are never touched here (there it would zero them).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Iterable

import torch
from torch import nn

_MADV_DONTNEED = 4  # linux/mman.h
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MAP_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ (\d+)\s*(.*)$")


def mapped_weights(model: nn.Module) -> list[torch.Tensor]:
    """The floating-point parameters of ``model`` that lie in a file mapping: what to hand
    :func:`release_dropped` after quantisation has replaced some of them. (Only those: holding
    the others -- a GGUF read into anonymous memory -- would keep each float weight alive until
    quantisation ends, where dropping the module frees it at once.)"""
    files = _file_mappings()
    if not files:
        return []
    out = []
    for p in model.parameters():
        if p.is_floating_point() and p.device.type == "cpu":
            lo, hi = _own_bytes(p)
            if any(a <= lo and hi <= b for a, b in files):
                out.append(p)
    return out


def release_dropped(model: nn.Module, before: Iterable[torch.Tensor]) -> int:
    """Give back the file-mapped pages of the tensors of ``before`` that ``model`` no longer
    holds (none of its parameters, buffers or kept dense weights overlaps them); returns the
    bytes given back. Call once the tensors are otherwise unused (quantisation done)."""
    live = [_span(t) for t in _held(model)]
    dropped = [_own_bytes(t) for t in before]
    files = _file_mappings()
    freed = 0
    for lo, hi in dropped:
        if any(a < hi and lo < b for a, b in live):
            continue  # still (partly) in use: a view of it lives on
        first, last = -(-lo // _PAGE) * _PAGE, hi // _PAGE * _PAGE  # whole pages inside it only
        if first < last and any(a <= first and last <= b for a, b in files):
            freed += _dontneed(first, last - first)
    return freed


def _held(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor ``model`` still reads: parameters, buffers, the plain tensor attributes of
    its modules (a quantised LM head's kept dense weight) and of the objects they hold (a
    quantised matmul's bias)."""
    out = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        for v in vars(module).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif hasattr(v, "__dict__") and not isinstance(v, nn.Module):
                out += [w for w in vars(v).values() if isinstance(w, torch.Tensor)]
    return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of ``t``'s whole storage: [start, end) addresses."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _own_bytes(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` itself covers (a contiguous view: its elements; else its storage)."""
    if not t.is_contiguous():
        return _span(t)
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _file_mappings(path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files (an inode, a path); none off Linux."""
    try:
        lines = open(path).read().splitlines()  # noqa: SIM115 (read at once)
    except OSError:
        return []
    out = []
    for line in lines:
        m = _MAP_LINE.match(line)
        if m and int(m.group(3)) != 0 and m.group(4).startswith("/"):
            out.append((int(m.group(1), 16), int(m.group(2), 16)))
    return out


def _dontneed(start: int, length: int) -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return 0
    return length if ok else 0

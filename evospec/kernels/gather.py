"""Row gather into the packed LM-head buffer: ``buf[slots[i]] = weight[ids[i]]``.

Owns: the one kernel that copies the LM-head rows of newly active token ids into their slots
of the reduced head's packed buffer, with a torch reference. It does not choose slots or ids
(``slots.py`` plans them; ``evospec.vocab.head`` owns the mapping).

Entries with ``ids[i] < 0`` are padding and copy nothing, so a plan of static length (the
head's capacity) can be launched without reading its true length back to the host. Slots of
valid entries must be distinct. The compiled kernel copies one ``BLOCK_D`` chunk of one row per
program (grid ``[n, ceil(D / BLOCK_D)]``); a padding program loads its id and exits.
"""

from __future__ import annotations

import torch

from evospec.kernels.dispatch import Backend, pick_backend

BLOCK_D = 512  # row elements copied per program (4096-wide rows: 8 programs per row)


def gather_rows_torch(
    weight: torch.Tensor, buf: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor
) -> None:
    """Reference: ``buf[slots[i]] = weight[ids[i]]`` for every ``ids[i] >= 0``.

    Without padding this is one indexed copy (no host round trip); with padding the valid
    entries are selected first, which reads their count back to the host.
    """
    if ids.numel() == 0:
        return
    valid = ids >= 0  # [n]
    if not bool(valid.all()):
        ids, slots = ids[valid], slots[valid]
    buf.index_copy_(0, slots, weight.index_select(0, ids))  # ~2x an indexed assignment on a CPU


def gather_rows(
    weight: torch.Tensor,  # [V, D]
    buf: torch.Tensor,  # [C, D], same dtype and device as weight
    ids: torch.Tensor,  # [n] int, < 0 = padding
    slots: torch.Tensor,  # [n] int
    backend: Backend | None = None,
) -> None:
    """Copy ``weight[ids[i]]`` into ``buf[slots[i]]`` for every valid entry, in place.

    ``backend`` defaults to :func:`~evospec.kernels.dispatch.pick_backend` for the buffer's
    device. The Triton paths never read anything back to the host.
    """
    if weight.ndim != 2 or buf.ndim != 2 or weight.shape[1] != buf.shape[1]:
        raise ValueError(f"row shapes differ: weight {tuple(weight.shape)}, buf {tuple(buf.shape)}")
    if ids.shape != slots.shape or ids.ndim != 1:
        raise ValueError(f"ids {tuple(ids.shape)} and slots {tuple(slots.shape)} must be equal 1-D shapes")
    if weight.dtype != buf.dtype:
        raise ValueError(f"dtype mismatch: weight {weight.dtype}, buf {buf.dtype}")
    backend = backend or pick_backend(buf.device)
    if backend == "torch" or ids.numel() == 0:
        gather_rows_torch(weight, buf, ids, slots)
        return
    if not (weight.is_contiguous() and buf.is_contiguous()):
        raise ValueError("the Triton gather needs contiguous weight and buffer rows")
    dim = weight.shape[1]
    block = min(BLOCK_D, max(16, 1 << (dim - 1).bit_length()))
    grid = (ids.shape[0], -(-dim // block))
    from evospec.kernels.triton_kernels import GATHER  # (imports triton: only here)

    GATHER.get(backend)[grid](weight, buf, ids.contiguous(), slots.contiguous(), dim, BLOCK=block)

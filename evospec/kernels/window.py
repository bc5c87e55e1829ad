"""NanoSpec window update on the device: append candidates to the ring, evict, recount.

Owns: the push of a batch of candidate ids into a candidate window's state -- ring ``[W]``
(stream entry g at ``ring[g % W]``, ``EMPTY`` = -1 before it fills), counts ``[V]`` (how many
window entries each id is) and head ``[1]`` (entries pushed so far, a device scalar) -- as a
Triton kernel and a torch reference, plus :func:`unique_padded`, NanoSpec's "unique draft-tree
tokens" in a fixed shape. It does not know where candidates come from or what the active set
is used for (``evospec.vocab.window`` wraps this state; the active bitmap is ``counts > 0``).

Entries ``< 0`` are padding: they are skipped and take no stream position, so a caller can
push a fixed-size, partly padded candidate buffer without reading its true length back.
Only the last W valid entries of a push can stay in the window, so only those are written.
Neither path reads anything back to the host; both leave the state bit-identical.
"""

from __future__ import annotations

import torch

from evospec.kernels.dispatch import Backend, pick_backend

EMPTY = -1  # ring entry that holds no stream entry yet
PAD = -1  # candidate entry to skip
BLOCK_N = 256  # candidates per loop step of the push kernel


def unique_padded(ids: torch.Tensor) -> torch.Tensor:
    """ids [n] -> [n]: the distinct values ascending (as ``torch.unique``), each once, with
    every repeat replaced by ``PAD``; the shape does not depend on the data."""
    if ids.numel() == 0:
        return ids.to(torch.int64)
    s = torch.sort(ids.to(torch.int64)).values  # [n]
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    return torch.where(first, s, PAD)


def window_push_torch(
    ring: torch.Tensor, counts: torch.Tensor, head: torch.Tensor, ids: torch.Tensor
) -> None:
    """Reference push of ids [n] (``< 0`` = padding) into ring [W], counts [V], head [1]."""
    w_max = ring.shape[0]
    ids = ids.to(device=ring.device, dtype=torch.int64)
    valid = ids >= 0  # [n]
    rank = torch.cumsum(valid, dim=0) - 1  # [n] stream offset of each valid entry in this push
    m = valid.sum()  # [] valid entries (stays on the device)
    keep = valid & (rank >= m - w_max)  # [n] the last W valid entries
    slot = torch.remainder(head + rank, w_max)  # [n] distinct where keep
    old = ring[slot]  # [n] entries they overwrite
    left = keep & (old >= 0)
    idx = torch.cat([old.clamp(min=0), ids.clamp(min=0)])  # [2n]
    delta = torch.cat([-left.to(counts.dtype), keep.to(counts.dtype)])  # [2n]
    counts.index_add_(0, idx, delta)
    # written value per ring slot; skipped entries scatter into a trash element
    staged = torch.full((w_max + 1,), PAD - 1, dtype=torch.int64, device=ring.device)  # [W + 1]
    staged.scatter_(0, torch.where(keep, slot, w_max), ids)
    staged = staged[:w_max]
    ring.copy_(torch.where(staged != PAD - 1, staged, ring))
    head.add_(m)


def window_push(
    ring: torch.Tensor,  # [W] int64
    counts: torch.Tensor,  # [V] int32
    head: torch.Tensor,  # [1] int64
    ids: torch.Tensor,  # [n] int, < 0 = padding; values < V
    backend: Backend | None = None,
) -> None:
    """Append the valid ``ids`` (in order) to the window state, in place."""
    if ids.ndim != 1:
        raise ValueError(f"push expects a 1-D tensor of ids, got shape {tuple(ids.shape)}")
    if ring.dtype != torch.int64 or counts.dtype != torch.int32 or head.shape != (1,):
        raise ValueError("window state must be ring int64 [W], counts int32 [V], head int64 [1]")
    if ids.numel() == 0:
        return
    backend = backend or pick_backend(ring.device)
    if backend == "torch":
        window_push_torch(ring, counts, head, ids)
        return
    ids = ids.to(device=ring.device, dtype=torch.int64).contiguous()
    from evospec.kernels.triton_kernels import PUSH  # (imports triton: only here)

    PUSH.get(backend)[(1,)](ids, ids.shape[0], ring, counts, head, ring.shape[0], BLOCK=BLOCK_N)

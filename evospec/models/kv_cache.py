"""Preallocated key/value cache with explicit verbs: write, advance, trim, compact.

Owns: the K/V tensors of every layer of one target (or draft) model for a batch of aligned
sequences, and the number of valid slots. Slot ``i`` holds sequence position ``i`` for every
committed token; tree verification temporarily writes draft-tree tokens after the committed
prefix and then ``compact``s the accepted ones into place. It knows nothing about tokens,
attention masks or models.
"""

from __future__ import annotations

import torch

from evospec.models.huge_pages import huge_zeros


class KVCache:
    """Keys and values for ``num_layers`` layers, ``max_len`` slots each, allocated once."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        if torch.device(device).type == "cpu":  # a big cache in 2 MB pages (huge_pages.py)
            self.k, self.v = huge_zeros(shape, dtype), huge_zeros(shape, dtype)  # [L, B, H_kv, S_max, Dh]
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, Dh]
            self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S_max, Dh]
        self.max_len = max_len
        self.length = 0  # committed slots; new tokens are written from here

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        self.length = 0

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ([B, H_kv, n, Dh]) at slots [length, length + n) of ``layer``.

        Returns the keys and values of slots [0, length + n) for attention. ``length`` itself
        moves only in :meth:`advance`, once every layer has written.
        """
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: need {end} slots, have {self.max_len}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        self.length += n

    def trim(self, length: int) -> None:
        """Rewind to ``length`` committed slots (later slots become garbage)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim to {length}: cache holds {self.length}")
        self.length = length

    def compact(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy slots ``src_slots`` ([m], ascending, all >= dst_start) to [dst_start, dst_start+m).

        Used after tree verification: the accepted path's slots move right behind the
        committed prefix and everything after them is dropped. Only the slots out of place
        move (a path's first nodes often lie there already; one moved slot is one copy per K/V).
        """
        slots = src_slots.tolist()
        m = len(slots)
        # the first slot out of place: the rest are too (ascending slots); m where none is
        first = next((i for i, s in enumerate(slots) if s != dst_start + i), m)
        if first == m - 1:  # a fan's child, or a path's last node: one slot of every layer
            src, dst = slots[first], dst_start + first
            self.k.select(3, dst).copy_(self.k.select(3, src))
            self.v.select(3, dst).copy_(self.v.select(3, src))
        elif first < m:
            idx = src_slots[first:].to(self.k.device)
            dst = slice(dst_start + first, dst_start + m)
            self.k[:, :, :, dst] = self.k.index_select(3, idx)
            self.v[:, :, :, dst] = self.v.index_select(3, idx)
        self.length = dst_start + m


class SlotCache:
    """The slice of :class:`KVCache`'s interface that attention uses, with the write position
    taken from ``slots``' size (symbolic while tracing): what a recorded step (``models/step.py``)
    or draft step (``models/draft_step.py``) hands its layers."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.k, self.v, self.slots = k, v, slots  # k, v [L, 1, H_kv, S_max, Dh]; slots [length + n]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # narrow, not [:, :, a:b]: a traced slice records a node per dimension it spans
        end, n = self.slots.shape[0], k.shape[2]
        keys, values = self.k[layer], self.v[layer]  # [B, H_kv, S_max, Dh]
        keys.narrow(2, end - n, n).copy_(k)
        values.narrow(2, end - n, n).copy_(v)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

"""Slot planning for the reduced LM head without reading anything back to the host.

Owns: :func:`plan_swap`, which turns the next active mask and the head's current slot mapping
into a static-length plan (ids leaving, ids entering and the slots they take), and
:func:`apply_swap`, which commits a plan to the mapping tensors. Both are plain tensor ops of
fixed shapes (``[V]``, ``[C]``): no ``nonzero``, no boolean indexing, so they queue on a CUDA
stream without a host synchronisation. The rows themselves move with
:func:`~evospec.kernels.gather.gather_rows`, which skips the plan's padding.

The assignment equals the host path of :meth:`evospec.vocab.head.ReducedHead.set_active`
exactly: ids leaving free their slots first; entering ids, ascending, take the free slots,
ascending. The capacity is not checked here (that needs the active count on the host; the
caller checks it where it synchronises anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FREE = -1  # slot id of an unused slot; also the padding of plan entries


@dataclass
class SwapPlan:
    """One active-set change of a head with capacity C over a vocabulary of V ids."""

    drop_ids: torch.Tensor  # [V] bool: ids that leave
    drop_slots: torch.Tensor  # [C] bool: slots those ids free
    add_ids: torch.Tensor  # [C] int64: entering ids, ascending, then FREE padding
    add_slots: torch.Tensor  # [C] int64: the slot each entering id takes (FREE for padding)


def _compact(flags: torch.Tensor, out_len: int) -> torch.Tensor:
    """[n] bool -> [out_len] int64: indices of the True entries, ascending, then FREE.

    Ranks come from a cumulative sum; entries past ``out_len`` and False entries scatter into
    a trash element that is cut off, so the shape never depends on the data.
    """
    n = flags.shape[0]
    rank = torch.cumsum(flags, dim=0) - 1  # [n]
    keep = flags & (rank < out_len)
    dest = torch.where(keep, rank, out_len)  # [n]
    out = torch.full((out_len + 1,), FREE, dtype=torch.int64, device=flags.device)
    out.scatter_(0, dest, torch.arange(n, dtype=torch.int64, device=flags.device))
    return out[:out_len]


def plan_swap(mask: torch.Tensor, slot_of: torch.Tensor, slot_ids: torch.Tensor) -> SwapPlan:
    """mask [V] bool (next active set), slot_of [V], slot_ids [C] (current mapping) -> plan."""
    capacity = slot_ids.shape[0]
    have = slot_of >= 0  # [V]
    drop_ids = have & ~mask  # [V]
    add = mask & ~have  # [V]
    held = slot_ids >= 0  # [C]
    drop_slots = held & drop_ids[slot_ids.clamp(min=0)]  # [C]
    free_after = ~held | drop_slots  # [C]
    add_ids = _compact(add, capacity)  # [C]
    free_slots = _compact(free_after, capacity)  # [C]
    add_slots = torch.where(add_ids >= 0, free_slots, FREE)  # [C]
    return SwapPlan(drop_ids, drop_slots, add_ids, add_slots)


def apply_swap(
    plan: SwapPlan,
    slot_of: torch.Tensor,  # [V] int64, updated in place
    slot_ids: torch.Tensor,  # [C] int64, updated in place
    bias: torch.Tensor,  # [C] float, updated in place (0 active, -inf free)
) -> None:
    """Commit ``plan`` to the mapping (rows are gathered separately); fixed shapes only."""
    vocab, capacity = slot_of.shape[0], slot_ids.shape[0]
    valid = plan.add_ids >= 0  # [C]
    # the id now held by each slot: scatter entering ids into their slots (padding -> trash)
    entering = torch.full((capacity + 1,), FREE, dtype=torch.int64, device=slot_ids.device)
    entering.scatter_(0, torch.where(valid, plan.add_slots, capacity), plan.add_ids)
    entering = entering[:capacity]  # [C]
    slot_ids.masked_fill_(plan.drop_slots, FREE)
    slot_ids.copy_(torch.where(entering >= 0, entering, slot_ids))
    bias.copy_(torch.where(slot_ids >= 0, 0.0, float("-inf")).to(bias.dtype))
    # the slot now held by each id
    slot_of.masked_fill_(plan.drop_ids, FREE)
    new_slot = torch.full((vocab + 1,), FREE, dtype=torch.int64, device=slot_of.device)
    new_slot.scatter_(0, torch.where(valid, plan.add_ids, vocab), plan.add_slots)
    new_slot = new_slot[:vocab]  # [V]
    slot_of.copy_(torch.where(new_slot >= 0, new_slot, slot_of))

"""The reduced draft LM head: logits over the active vocabulary only.

Owns: the one mapping between draft-vocabulary *slots* and absolute target token ids, a
preallocated packed buffer of LM-head rows (one row per slot), and the incremental update
that gathers only the rows of ids that became active. Knows nothing about how the active set
is chosen (that is a :class:`~evospec.vocab.policy.VocabPolicy`).

Shapes are static: the buffer holds ``capacity`` rows for the whole request; a free slot has
id ``FREE`` (-1) and a logit bias of ``-inf``, so the projection is always ``[n, capacity]``
and a free slot can never be proposed. Tree tokens leave this module as target ids; the
target still verifies over its full vocabulary, so the active set changes speed, never output.

Row formats: the LM head's own dtype (fp32; packed in oneDNN blocks on the CPU from
``PACK_MIN_ROWS`` slots), or, when the target's LM head is int8 (``--weights int4|int8``), its
int8 codes and per-row scales gathered as they are: the projection reads a quarter of the
bytes and gives those ids' int8 logits (through torch's int8 kernel, bf16 activations: the
target's own head may run the VNNI kernel, ``kernels/int8_matmul.py``, and round otherwise;
a draft's logits only shape proposals, never the output). An int4 draft (``--draft-weights
int4``, the default on the fused CPU ops) with a steady policy (its set changes rarely) projects
those rows rounded to 4-bit groups through the int4 kernel instead: 4.4 of the 7.1 MB a
12,288-slot projection reads (``_SlotTiles4``; a change repacks whole tiles).

Two ways to load a set. :meth:`ReducedHead.set_active` plans on the host (``nonzero``) and
copies the rows at once. :meth:`ReducedHead.stage` (the GPU path) plans with fixed-shape
tensor ops (``evospec.kernels.slots``) and queues plan and row gather on the device's copy
stream, then records an event; the next head call makes the compute stream wait for it right
before the projection, so the gather hides behind whatever the compute stream runs meanwhile
(the draft backbone). Both paths give bit-identical slots and rows; the row copy goes through
``evospec.kernels.gather`` (Triton on CUDA, torch otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from evospec.kernels.dispatch import Backend, pick_backend
from evospec.kernels.gather import gather_rows
from evospec.kernels.slots import apply_swap, plan_swap
from evospec.kernels.streams import copy_stream, follow_current, on_stream, record_event, wait_event
from evospec.models.huge_pages import huge_copy
from evospec.models.packing import PackedRows, packing_available
from evospec.models.quant import Int8Matmul

FREE = -1  # slot id placeholder of an unused slot
# From this many slots on, a CPU fp32 buffer is projected through oneDNN-packed blocks
# (``PackedRows``): Gemma's 16k EvoSpec core spent 11.5 -> 8.0 ms per round in its draft LM
# head (docs/benchmarks.md). Smaller buffers keep the dense product: NanoSpec's 3k-slot window
# rewrites rows every round, and a block repack (~6 ms) would cost more than it saves.
PACK_MIN_ROWS = 8192
PACK_BLOCK = 4096
Projection = Callable[[torch.Tensor], torch.Tensor]  # hidden [n, D] -> logits [n, V]
# Picks each row's proposal instead of the top-k: (log-probs [n, C] over the head's columns, the
# columns' target ids [C] or None where column = id) -> (log-probs [n, k], target ids [n, k]).
# Under sampling a chain draws its tokens this way (``decoding/proposal.py: DraftSampler``).
Chooser = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def top_k(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k], columns [n, k]) of the k largest per row: ``torch.topk``, or for k = 1 a
    row max (a third of topk's time over a 12k-column row; a chain drafts with k = 1)."""
    if k == 1:
        return logp.max(dim=-1, keepdim=True)
    top = torch.topk(logp, k, dim=-1)
    return top.values, top.indices


@dataclass
class HeadTimings:
    """Wall time spent in the reduced head since the last :meth:`ReducedHead.take_timings`."""

    lm_head_s: float = 0.0  # projection + log-softmax + top-k
    gather_s: float = 0.0  # copying newly active rows into the packed buffer
    rows_gathered: int = 0


class FullHead:
    """Top-k over the full vocabulary through the target's LM head (the EAGLE-2 baseline), or
    over an EAGLE-3 head's own LM head (its rows: the full vocabulary, or a reduced draft
    vocabulary mapped back to target ids by ``row_ids``)."""

    def __init__(
        self, weight: torch.Tensor, project: Projection | None = None, row_ids: torch.Tensor | None = None
    ) -> None:
        self.weight = weight  # [V, D], or [V_d, D] rows of a reduced draft vocabulary
        self.project = project or (lambda h: h @ weight.T)  # [n, D] -> [n, V], e.g. a packed matmul
        self.row_ids = row_ids  # [V_d] target id of each row (EAGLE-3 d2t heads); None: row = id
        self.timings = HeadTimings()

    @property
    def size(self) -> int:
        return self.weight.shape[0]

    def __call__(
        self, hidden: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        logp = torch.log_softmax(self.project(hidden).float(), dim=-1)  # [n, V]
        if choose is not None:
            out = choose(logp, self.row_ids)
        else:
            values, cols = top_k(logp, k)
            out = values, cols if self.row_ids is None else self.row_ids[cols]  # target ids
        self.timings.lm_head_s += time.perf_counter() - t0
        return out

    def take_timings(self) -> HeadTimings:
        out, self.timings = self.timings, HeadTimings()
        return out


class ReducedHead:
    """Top-k over the active slots; a :class:`~evospec.decoding.drafter.DraftHeadFn`."""

    def __init__(
        self,
        weight: torch.Tensor,
        capacity: int,
        backend: Backend | None = None,
        *,
        pack_min_rows: int | None = None,  # default PACK_MIN_ROWS
        pack_block: int | None = None,  # default PACK_BLOCK
        int8: Int8Matmul | None = None,  # the target LM head's int8 codes: gather those rows instead
        int4: bool = False,  # with int8: project through 4-bit tiles of those rows (an int4 draft)
    ) -> None:
        vocab, dim = weight.shape
        if capacity < 1:
            raise ValueError(f"reduced head capacity must be >= 1, got {capacity}")
        self.weight = weight  # [V, D] the target's LM head (shared, never copied whole)
        self.capacity = min(capacity, vocab)
        self.int8 = int8
        dtype = torch.int8 if int8 is not None else weight.dtype  # the rows gathered: codes, or floats
        self.rows = torch.zeros(self.capacity, dim, dtype=dtype, device=weight.device)  # [C, D]
        # int8 rows: one bf16 scale per slot, gathered with the row
        self.row_scale = (
            torch.ones(self.capacity, dtype=torch.bfloat16, device=weight.device)
            if int8 is not None
            else None
        )
        # the VNNI kernel's tiles of the same rows, where the target's head runs that kernel: its
        # int8 codes as they are, or (``int4``) rounded to 4-bit groups as the draft's layer is
        vnni = int8 is not None and int8.kernel == "vnni"
        self.tiles = None
        if vnni:
            self.tiles = _SlotTiles4(self.rows) if int4 else _SlotTiles(self.capacity, dim)
        self.slot_ids = torch.full((self.capacity,), FREE, dtype=torch.long, device=weight.device)  # [C]
        self.slot_of = torch.full((vocab,), FREE, dtype=torch.long, device=weight.device)  # [V]
        self.bias = torch.full((self.capacity,), float("-inf"), dtype=torch.float32, device=weight.device)
        self.size = 0  # active slots (host-side count)
        # a greedy step's top-1 in one op where the slots are 4-bit tiles (False: projection,
        # log-softmax and row max as three calls; scripts/drafting_ab.py compares the two)
        self.top1_op = True
        self.timings = HeadTimings()
        self.backend: Backend = backend or pick_backend(weight.device)  # row-gather kernel
        self._ready: torch.cuda.Event | None = None  # a staged load still running on the copy stream
        pack = (
            int8 is None
            and self.capacity >= (pack_min_rows or PACK_MIN_ROWS)
            and packing_available(self.rows)
        )
        self.packed = PackedRows(self.rows, pack_block or PACK_BLOCK) if pack else None  # CPU: oneDNN blocks

    @property
    def vocab_size(self) -> int:
        return self.slot_of.shape[0]

    def active_mask(self) -> torch.Tensor:
        """[V] bool: ids that currently hold a slot."""
        self._wait_staged()
        return self.slot_of >= 0

    def set_active(self, mask: torch.Tensor) -> int:
        """Make the active ids exactly ``mask`` ([V] bool); gather only new rows. Returns rows gathered.

        Raises ``ValueError`` if ``mask`` holds more ids than the capacity.
        """
        t0 = time.perf_counter()
        self._wait_staged()
        have = self.slot_of >= 0
        drop = torch.nonzero(have & ~mask).flatten()  # [d] ids leaving
        add = torch.nonzero(mask & ~have).flatten()  # [a] ids entering
        new_size = self.size - drop.numel() + add.numel()
        if new_size > self.capacity:
            raise ValueError(f"active vocabulary of {new_size} ids exceeds the head capacity {self.capacity}")
        if drop.numel():
            slots = self.slot_of[drop]
            self.slot_ids[slots] = FREE
            self.bias[slots] = float("-inf")
            self.slot_of[drop] = FREE
        if add.numel():
            free = torch.nonzero(self.slot_ids == FREE).flatten()[: add.numel()]  # [a]
            if self.int8 is not None:
                self.rows[free] = self.int8.weight_rows(add)
                self.row_scale[free] = self.int8.scale[add]
                if self.tiles is not None:
                    self.tiles.write(free, self.rows[free], self.int8.scale_f32[add])
            else:
                gather_rows(self.weight, self.rows, add, free, self.backend)
            if self.packed is not None:
                self.packed.touch(free)
            self.slot_ids[free] = add
            self.slot_of[add] = free
            self.bias[free] = 0.0
        self.size = new_size
        self.timings.gather_s += time.perf_counter() - t0
        self.timings.rows_gathered += add.numel()
        return add.numel()

    def stage(self, mask: torch.Tensor) -> int:
        """Start making the active ids ``mask`` ([V] bool): the GPU path of :meth:`set_active`.

        Reads two counts back to the host (new size, rows to gather) -- call it where the
        decode loop synchronises anyway (the accept boundary) -- then queues the slot plan and
        the row gather on the copy stream (inline off CUDA) and returns the rows gathered. The
        next :meth:`__call__` waits for them on the device. Raises ``ValueError`` if ``mask``
        holds more ids than the capacity (nothing is changed then).
        """
        if self.int8 is not None:  # a CPU-only format: the host path does the same work
            return self.set_active(mask)
        t0 = time.perf_counter()
        self._wait_staged()
        new_size, added = (int(x) for x in torch.stack([mask.sum(), (mask & (self.slot_of < 0)).sum()]))
        if new_size > self.capacity:
            raise ValueError(f"active vocabulary of {new_size} ids exceeds the head capacity {self.capacity}")
        stream = copy_stream(self.rows.device)
        follow_current(stream, mask)
        with on_stream(stream):
            plan = plan_swap(mask, self.slot_of, self.slot_ids)
            gather_rows(self.weight, self.rows, plan.add_ids, plan.add_slots, self.backend)  # [C] padded
            apply_swap(plan, self.slot_of, self.slot_ids, self.bias)
        if self.packed is not None:  # the CPU run of this path: which rows moved is on the device
            self.packed.invalidate()
        self._ready = record_event(stream)
        self.size = new_size
        self.timings.gather_s += time.perf_counter() - t0  # host time to queue it, on CUDA
        self.timings.rows_gathered += added
        return added

    def _wait_staged(self) -> None:
        """Order the current stream after a staged load, if one is pending (no host wait)."""
        if self._ready is not None:
            wait_event(self._ready)
            self._ready = None

    def clear(self) -> None:
        self.set_active(torch.zeros(self.vocab_size, dtype=torch.bool, device=self.slot_of.device))

    def __call__(
        self, hidden: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, D] -> top-k over the active ids: (log-probs [n, k'], target ids [n, k']),
        or what ``choose`` picks from the log-probs over the slots.

        k' = min(k, active size): a free slot (log-prob -inf) is never returned.
        """
        t0 = time.perf_counter()
        self._wait_staged()  # a staged load: the compute stream waits here, not earlier
        if k == 1 and choose is None and self.size and self.top1_op and isinstance(self.tiles, _SlotTiles4):
            out = self.tiles.top1(hidden, self.bias, self.slot_ids)  # one op: a greedy chain's step
            self.timings.lm_head_s += time.perf_counter() - t0
            return out
        logits = self._project(hidden).float()  # [n, C] a fresh tensor (or a view of one)
        logp = torch.log_softmax(logits.add_(self.bias), dim=-1)
        if choose is not None:
            out = choose(logp, self.slot_ids)
        else:
            values, cols = top_k(logp, min(k, self.size))
            out = values, self.slot_ids[cols]  # [n, k'] absolute target ids
        self.timings.lm_head_s += time.perf_counter() - t0
        return out

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, C]
        if self.tiles is not None:
            return self.tiles.project(hidden)
        if self.int8 is not None:
            return torch.ops.aten._weight_int8pack_mm(hidden.to(torch.bfloat16), self.rows, self.row_scale)
        return self.packed(hidden) if self.packed is not None else hidden @ self.rows.T

    def take_timings(self) -> HeadTimings:
        """Return and reset the accumulated timings."""
        out, self.timings = self.timings, HeadTimings()
        return out


class _SlotTiles:
    """The active slots' int8 codes in the VNNI kernel's tile layout (``kernels/int8_matmul.py``:
    16 output rows x 32 inputs per 512-byte block), kept in step with the row-major buffer one
    slot at a time, so a set change rewrites only its new slots' bytes and the projection reads
    int8 activations against int8 codes as the target's own head does: each slot's logit is
    bitwise the full head's for its id (a kernel output depends on its own row only). frspec's
    12k slots, one row: 0.15 ms against 0.23 ms for torch's bf16-activation kernel, warm
    (docs/benchmarks.md, wave 13)."""

    def __init__(self, capacity: int, dim: int) -> None:
        from evospec.kernels.int8_matmul import TILE, pack_int8

        self.capacity = capacity
        padded = -(-capacity // TILE) * TILE  # the kernel takes whole tiles; pad slots are never read
        self.packed = huge_copy(pack_int8(torch.zeros(padded, dim, dtype=torch.int8)))  # [C16/16, D/32, 512]
        self.scale = torch.zeros(padded, dtype=torch.float32)  # [C16]

    def write(self, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Slots [a] take ``codes`` int8 [a, D] and ``scale`` float32 [a]."""
        from evospec.kernels.int8_matmul import write_int8_rows

        write_int8_rows(self.packed, slots, codes)
        self.scale[slots] = scale

    def project(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, C] float32
        out = torch.ops.evospec.int8_matmul(hidden.float(), self.packed, self.scale)
        return out[:, : self.capacity]


class _SlotTiles4:
    """The active slots' rows in the int4 kernel's tile layout (``kernels/int4_matmul.py``: 16
    output rows x 32 inputs per block, a scale and zero per row and group), rounded from the
    slots' int8 rows by Q4_1's rule: the reduced head of an int4 draft (``--draft-weights int4``)
    reads 4.4 MB a projection instead of 7.1 (frspec's 12,288 slots), cold after every target
    step on a CPU whose L3 the target's weights stream through. A set change repacks the 16-slot
    tiles its new slots fall in, from the head's row-major int8 buffer ``rows`` (shared, written
    before :meth:`write`). Its logits are the 4-bit rows', not the target's for those ids: a
    draft's numbers only shape proposals."""

    def __init__(self, rows: torch.Tensor) -> None:  # rows: the head's [C, D] int8 slot buffer
        from evospec.kernels.int4_matmul import GROUP, TILE, pack_int4

        self.rows = rows
        self.capacity, dim = rows.shape
        self.scale = torch.zeros(self.capacity)  # [C] float32, each slot's int8 scale
        padded = -(-self.capacity // TILE) * TILE  # whole tiles; pad slots hold zeros
        zeros = torch.zeros(padded, dim // GROUP)
        empty = torch.zeros(padded, dim, dtype=torch.uint8)
        self.packed = huge_copy(pack_int4(empty, zeros, zeros))  # [C16/16, D/32, 320]

    def write(self, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Slots [a] took ``codes`` int8 [a, D] (already in the shared buffer) and ``scale``
        float32 [a]: repack the tiles they fall in."""
        from evospec.kernels.int4_matmul import TILE, pack_int4
        from evospec.models.quant import GroupCodes

        self.scale[slots] = scale
        tiles = torch.unique(slots // TILE)  # [u]
        idx = (tiles[:, None] * TILE + torch.arange(TILE)).flatten()  # [u * 16] slots, pads past C
        real = idx < self.capacity
        safe = idx.clamp(max=self.capacity - 1)
        w = self.rows[safe].float() * (self.scale[safe] * real)[:, None]  # [u * 16, D]
        codes = GroupCodes.from_float(w)
        self.packed[tiles] = pack_int4(codes.codes, codes.scale, codes.zero - 8 * codes.scale)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, C] float32
        return torch.ops.evospec.int4_matmul(hidden.float(), self.packed)[:, : self.capacity]

    def top1(
        self, hidden: torch.Tensor, bias: torch.Tensor, slot_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, D] -> the head's top-1 (log-prob [n, 1], target id [n, 1]) over the slots
        (``bias`` [C]: -inf for a free one) in one op: what projecting, the log-softmax and a
        row max give, the log-prob summed in another order. After a target forward each of
        those ops ran cold (~0.1 ms of a drafted round's ~0.6)."""
        return torch.ops.evospec.int4_top1(hidden.float(), self.packed, bias, slot_ids)


class TwoStageHead:
    """SpecVocab's draft head: each row ranks the vocabulary with a low-rank selector, keeps its
    top ``candidates`` ids (plus the always-active ids) and takes exact logits over those only.

    Exact logits come from the draft LM head's own rows (fp32, or the target's int8 codes and
    scales, as :class:`ReducedHead` gathers them), so a candidate's logit is the one the full
    head would give it; the log-softmax runs over the row's candidates. Rows of one call share
    one gather: the union of their candidates [u], each row masked to its own. ``seen`` [V]
    collects every id that was a candidate since :meth:`new_round` (the round's active set).
    With an int8 head the selector's codes are ranked in int8 too (per-row scales): ranking is
    approximate by design, and only which ids become candidates depends on it.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        selector,  # vocab/selector.py: LowRankSelector ([n, D] -> [n, V] approximate logits)
        candidates: int,
        *,
        always: torch.Tensor | None = None,
        int8: Int8Matmul | None = None,
    ) -> None:
        vocab = weight.shape[0]
        self.weight = weight  # [V, D]
        self.selector = selector
        self.candidates = min(candidates, vocab)
        self.int8 = int8
        # the int8 head's codes row-major (built from its tiles): ~2,048 rows gathered a draft step
        # want contiguous rows (0.01 ms, against ~0.5 ms read back from the tiles each time)
        self._rows8 = int8.codes if int8 is not None else None  # [V, D]
        self.always = (
            torch.zeros(0, dtype=torch.long, device=weight.device)
            if always is None
            else always.nonzero().flatten()
        )  # [e]
        self.capacity = self.candidates + self.always.numel()
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=weight.device)  # [V]
        self.timings = HeadTimings()
        self._codes8 = None
        # rank in int8 as well (a quarter of the selector's fp32 bytes) where the kernel takes the
        # rank: aten's int8 matmul needs a reduction length that is a multiple of 16
        if int8 is not None and selector.rank % 16 == 0:
            codes = selector.codes.detach().float()  # [V, r]
            scale = (codes.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [V]
            self._codes8 = (torch.round(codes / scale[:, None]).to(torch.int8), scale.to(torch.bfloat16))

    @property
    def size(self) -> int:
        """Ids that were candidates this round."""
        return int(self.seen.sum())

    def new_round(self) -> None:
        self.seen.zero_()

    def _approx(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, D] -> [n, V]
        if self._codes8 is None:
            return self.selector(hidden.float())
        z = (hidden.float() @ self.selector.down).to(torch.bfloat16)  # [n, r]
        return torch.ops.aten._weight_int8pack_mm(z, *self._codes8)

    def __call__(
        self, hidden: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        n = hidden.shape[0]
        cand = torch.topk(self._approx(hidden), self.candidates, dim=-1, sorted=False).indices  # [n, K]
        rows = torch.cat([cand, self.always.expand(n, -1)], dim=1)  # [n, K + e]
        union, slot = torch.unique(rows, return_inverse=True)  # [u], [n, K + e]
        exact = self._exact(hidden, union).float()  # [n, u]
        logits = torch.full_like(exact, float("-inf"))
        logits.scatter_(1, slot, exact.gather(1, slot))  # each row keeps its own candidates
        logp = torch.log_softmax(logits, dim=-1)  # [n, u]
        if choose is not None:
            out = choose(logp, union)
        else:  # k' = min(k, K): a row holds at least K distinct ids, so no masked slot is returned
            top = torch.topk(logp, min(k, self.candidates), dim=-1)
            out = top.values, union[top.indices]
        self.seen[union] = True
        self.timings.lm_head_s += time.perf_counter() - t0
        return out

    def _exact(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # [n, D], [u] -> [n, u]
        if self.int8 is not None:
            codes, scale = self._rows8.index_select(0, ids), self.int8.scale.index_select(0, ids)
            return torch.ops.aten._weight_int8pack_mm(hidden.to(torch.bfloat16), codes, scale)
        return hidden @ self.weight.index_select(0, ids).T

    def take_timings(self) -> HeadTimings:
        out, self.timings = self.timings, HeadTimings()
        return out

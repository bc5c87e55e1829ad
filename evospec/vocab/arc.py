"""ARC buffer for the dynamic part of the draft vocabulary (EvoSpec's ``V_dyn``).

Owns: which retrieved token ids stay resident in the fixed-budget dynamic buffer, and the
bookkeeping ARC needs to decide that (two resident lists, two ghost lists, the target size
``p``, a residency clock). Pure Python, no torch. It knows token ids only: not where they came
from (HNSW, co-occurrence graph, target top-k), not the static core, not how the active LM-head
rows are packed. The caller turns ``ids()`` into whatever the draft head needs.

Glossary (the words used below and in the callers):

- **resident**: in T1 or T2, i.e. part of the dynamic vocabulary now.
- **T1** (recent): resident ids seen once since they were (re)admitted.
- **T2** (frequent): resident ids with at least two pieces of evidence (a hit, or a ghost hit).
- **B1 / B2** (ghosts): ids recently evicted from T1 / T2. Only the id is remembered.
- **p**: ARC's adaptive target size of T1 (a float in ``[0, capacity]``).
- **failure event**: one OOV event after verification; its retrieval result, in priority
  order, is one call of :meth:`ARCBuffer.admit`.
- **round**: one draft + verify cycle; the caller reports each with :meth:`ARCBuffer.tick`.

The algorithm (ARC: Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST 2003), as used here for a batch of ids from one failure event:

1. The batch is deduplicated, keeping the first occurrence of each id (its priority order).
2. Each id, in order:

   - resident -> a **hit**: it moves to the MRU end of T2 (a T1 id is promoted). Not an
     insertion, never refused.
   - in B1 -> a **ghost hit**: T1 was evicted too eagerly, so ``p`` grows by
     ``max(|B2| / |B1|, 1)`` (capped at ``capacity``); room is made and the id enters T2.
   - in B2 -> a ghost hit on the frequent side: ``p`` shrinks by ``max(|B1| / |B2|, 1)``
     (floored at 0); room is made and the id enters T2.
   - otherwise -> **new**: room is made if the buffer is full, and the id enters T1.

3. Making room (ARC's REPLACE, only when ``|T1| + |T2| == capacity``): evict from T1 when T1
   is non-empty and either ``|T1| > p``, or the incoming id came from B2 and ``|T1| == p``;
   otherwise evict from T2. The victim leaves for the MRU end of the matching ghost list
   (T1 -> B1, T2 -> B2).

EvoSpec's changes (Appendix C, Table 7 of the paper), all set in :class:`ARCConfig`:

- **Separate ghost caps.** Classic ARC bounds the whole directory at ``2 * capacity`` and
  trims ghosts on a miss; here B1 and B2 each keep at most ``ghost_capacity`` ids and drop
  their own LRU end when a new ghost would overflow them. Nothing else trims them.
- **Insertion cap.** At most ``max_insert`` new/ghost ids are inserted per ``admit`` call;
  the ones after that are **refused**. Hits never count towards the cap.
- **Minimum residency.** An id can be evicted only after ``min_residency`` rounds
  (:meth:`tick` calls) in the buffer. Residency counts from the id's insertion into T1 or T2;
  a promotion T1 -> T2 or a move to the MRU end keeps it (promotion is evidence the id is
  useful, not a fresh arrival, so it must not make the id look newer). The victim is the
  least-recently-used *old enough* id of the list REPLACE chose; if that list has none, the
  other list's least-recently-used old enough id; if no resident id is old enough, the
  incoming id is refused.
- **Warm-up.** During the first ``warmup_events`` calls of ``admit`` the target ``p`` stays at
  its initial value; ghost hits are still promoted into T2.

A refused id changes nothing: ``p`` is not adapted, a ghost stays where it was, nothing is
evicted. A ghost hit is counted in :attr:`AdmitResult.ghost_hits` only when it is inserted.

Cost: every step is O(1) on ``OrderedDict``s except the residency search for a victim, which
skips only ids younger than ``min_residency`` rounds (those inserted during the last
``min_residency`` ticks), so it is O(1) when ``min_residency == 0`` and bounded by the recent
insertions otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

_STATE_VERSION = 1


@dataclass(frozen=True)
class ARCConfig:
    """Budget and safeguards of the ARC buffer (defaults: EvoSpec's Table 7)."""

    capacity: int = 256  # resident ids: |T1| + |T2| <= capacity
    ghost_capacity: int = 256  # each ghost list separately: |B1| <= this, |B2| <= this
    p_init: int = 128  # initial target size of T1, clamped to [0, capacity]
    max_insert: int = 32  # new/ghost insertions per admit() call (one failure event)
    min_residency: int = 8  # rounds (tick() calls) an id must be resident before eviction
    warmup_events: int = 50  # p stays fixed during the first this-many admit() calls

    def __post_init__(self) -> None:
        for name in ("capacity", "ghost_capacity", "max_insert", "min_residency", "warmup_events"):
            if getattr(self, name) < 0:
                raise ValueError(f"ARCConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class AdmitResult:
    """What one :meth:`ARCBuffer.admit` call did with each (deduplicated) id of its batch."""

    inserted: list[int] = field(default_factory=list)  # new or ghost ids now resident, in order
    hits: list[int] = field(default_factory=list)  # ids already resident (moved to T2 MRU)
    evicted: list[int] = field(default_factory=list)  # ids that left T1/T2 to make room
    refused: list[int] = field(default_factory=list)  # over the insertion cap, or no old victim
    ghost_hits: int = 0  # inserted ids that came from B1 or B2


def _as_ids(ids: Iterable[int]) -> list[int]:
    """Plain ints, first occurrence kept; accepts anything with ``tolist()`` (tensor, array)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()  # type: ignore[union-attr]
    out = list(dict.fromkeys(int(i) for i in ids))
    for tok in out:
        if tok < 0:
            raise ValueError(f"token ids must be >= 0, got {tok}")
    return out


class ARCBuffer:
    """Fixed-budget set of token ids managed by ARC with EvoSpec's safeguards (see module doc)."""

    def __init__(self, cfg: ARCConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else ARCConfig()
        # resident lists, LRU first: id -> clock value at its insertion into T1/T2
        self._t1: OrderedDict[int, int] = OrderedDict()
        self._t2: OrderedDict[int, int] = OrderedDict()
        # ghost lists, LRU first (values unused)
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = 0.0
        self._clock = 0
        self._events = 0
        self.reset()

    # -- lifecycle -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty every list, ``p`` back to ``p_init``, clock and event count to 0."""
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._p = float(min(max(self.cfg.p_init, 0), self.cfg.capacity))
        self._clock = 0
        self._events = 0

    def tick(self) -> None:
        """One decoding round has passed (every resident id is one round older)."""
        self._clock += 1

    # -- views ---------------------------------------------------------------------------------
    def ids(self) -> list[int]:
        """Resident ids: T1 then T2, each LRU -> MRU."""
        return [*self._t1, *self._t2]

    def __contains__(self, tok: object) -> bool:
        return tok in self._t1 or tok in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @property
    def p(self) -> float:
        """ARC's current target size of T1, in ``[0, capacity]``."""
        return self._p

    @property
    def t1(self) -> tuple[int, ...]:
        return tuple(self._t1)

    @property
    def t2(self) -> tuple[int, ...]:
        return tuple(self._t2)

    @property
    def b1(self) -> tuple[int, ...]:
        return tuple(self._b1)

    @property
    def b2(self) -> tuple[int, ...]:
        return tuple(self._b2)

    @property
    def events(self) -> int:
        """``admit`` calls so far (failure events)."""
        return self._events

    @property
    def clock(self) -> int:
        """``tick`` calls so far (rounds)."""
        return self._clock

    def residency(self, tok: int) -> int | None:
        """Rounds ``tok`` has been resident, or None when it is not resident."""
        since = self._t1.get(tok, self._t2.get(tok))
        return None if since is None else self._clock - since

    # -- evidence ------------------------------------------------------------------------------
    def touch(self, ids: Iterable[int]) -> int:
        """Usage evidence (e.g. accepted tokens): each resident id is a hit; returns the hits.

        Distinct ids count once (first occurrence order). Non-resident ids are ignored: no
        insertion, and a ghost is not a hit here (only ``admit`` adapts ``p``).
        """
        n = 0
        for tok in _as_ids(ids):
            if self._hit(tok):
                n += 1
        return n

    def admit(self, ids: Iterable[int]) -> AdmitResult:
        """One failure event: ``ids`` is its retrieval result in priority order."""
        self._events += 1
        adapt = self._events > self.cfg.warmup_events
        res = AdmitResult()
        budget = self.cfg.max_insert
        for tok in _as_ids(ids):
            if self._hit(tok):
                res.hits.append(tok)
                continue
            if budget == 0:
                res.refused.append(tok)
                continue
            from_b1, from_b2 = tok in self._b1, tok in self._b2
            p = self._p
            if adapt and from_b1:
                p = min(p + max(len(self._b2) / len(self._b1), 1.0), float(self.cfg.capacity))
            elif adapt and from_b2:
                p = max(p - max(len(self._b1) / len(self._b2), 1.0), 0.0)
            victim: tuple[int, bool] | None = None  # (id, evicted from T1)
            if len(self) >= self.cfg.capacity:
                victim = self._choose_victim(p, from_b2)
                if victim is None:
                    res.refused.append(tok)
                    continue
            # committed from here on
            self._p = p
            if from_b1:
                del self._b1[tok]
            elif from_b2:
                del self._b2[tok]
            if victim is not None:
                self._evict(*victim)
                res.evicted.append(victim[0])
            (self._t2 if from_b1 or from_b2 else self._t1)[tok] = self._clock
            res.inserted.append(tok)
            res.ghost_hits += int(from_b1 or from_b2)
            budget -= 1
        return res

    # -- internals -----------------------------------------------------------------------------
    def _hit(self, tok: int) -> bool:
        """Move a resident id to the MRU end of T2, keeping its residency; False if not resident."""
        if tok in self._t1:
            self._t2[tok] = self._t1.pop(tok)
            return True
        if tok in self._t2:
            self._t2.move_to_end(tok)
            return True
        return False

    def _oldest_enough(self, lst: OrderedDict[int, int]) -> int | None:
        """LRU-most id of ``lst`` resident for at least ``min_residency`` rounds."""
        for tok, since in lst.items():
            if self._clock - since >= self.cfg.min_residency:
                return tok
        return None

    def _choose_victim(self, p: float, from_b2: bool) -> tuple[int, bool] | None:
        """REPLACE's choice under target ``p``, honouring minimum residency."""
        n1 = len(self._t1)
        prefer_t1 = n1 > 0 and (n1 > p or (from_b2 and n1 == p))
        order = ((self._t1, True), (self._t2, False))
        for lst, is_t1 in order if prefer_t1 else order[::-1]:
            tok = self._oldest_enough(lst)
            if tok is not None:
                return tok, is_t1
        return None

    def _evict(self, tok: int, from_t1: bool) -> None:
        src, ghost = (self._t1, self._b1) if from_t1 else (self._t2, self._b2)
        del src[tok]
        ghost[tok] = None
        while len(ghost) > self.cfg.ghost_capacity:
            ghost.popitem(last=False)

    # -- persistence (admin API) ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able snapshot: config, p, clock, events, lists LRU -> MRU (T1/T2 with residency
        start ``[id, since]``)."""
        return {
            "version": _STATE_VERSION,
            "config": asdict(self.cfg),
            "p": self._p,
            "clock": self._clock,
            "events": self._events,
            "t1": [[tok, since] for tok, since in self._t1.items()],
            "t2": [[tok, since] for tok, since in self._t2.items()],
            "b1": list(self._b1),
            "b2": list(self._b2),
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` snapshot taken under the same config; ValueError if the
        config differs or the snapshot breaks an invariant (state is untouched then)."""
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ARC state version {d.get('version')!r}")
        if ARCConfig(**d["config"]) != self.cfg:
            raise ValueError(f"ARC state was saved under {d['config']}, this buffer has {self.cfg}")
        t1 = OrderedDict((int(tok), int(since)) for tok, since in d["t1"])
        t2 = OrderedDict((int(tok), int(since)) for tok, since in d["t2"])
        b1: OrderedDict[int, None] = OrderedDict((int(tok), None) for tok in d["b1"])
        b2: OrderedDict[int, None] = OrderedDict((int(tok), None) for tok in d["b2"])
        p, clock, events = float(d["p"]), int(d["clock"]), int(d["events"])
        lists = (t1, t2, b1, b2)
        if sum(map(len, lists)) != len(set().union(*lists)):
            raise ValueError("ARC state lists overlap or repeat ids")
        if any(tok < 0 for lst in lists for tok in lst):
            raise ValueError("ARC state holds negative token ids")
        if len(t1) + len(t2) > self.cfg.capacity:
            raise ValueError("ARC state holds more resident ids than the capacity")
        if max(len(b1), len(b2)) > self.cfg.ghost_capacity:
            raise ValueError("ARC state holds more ghosts than the ghost capacity")
        if not 0.0 <= p <= self.cfg.capacity:
            raise ValueError(f"ARC state p={p} outside [0, {self.cfg.capacity}]")
        if any(since > clock for since in (*t1.values(), *t2.values())):
            raise ValueError("ARC state has residency starts after its clock")
        self._t1, self._t2, self._b1, self._b2 = t1, t2, b1, b2
        self._p, self._clock, self._events = p, clock, events

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> ARCBuffer:
        """A buffer with the snapshot's own config and state."""
        buf = cls(ARCConfig(**d["config"]))
        buf.load_state_dict(d)
        return buf

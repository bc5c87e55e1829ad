"""ARC buffer: hand-worked sequences on a 4-slot buffer, persistence, random invariants.

Unless a test says otherwise: capacity 4, ghost lists of 4, p starts at 2, at most 3
insertions per event, no minimum residency, no warm-up. Every expected list is written out by
hand as (LRU, ..., MRU).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from typing import Any

import pytest

from evospec.vocab.arc import AdmitResult, ARCBuffer, ARCConfig


def small(**overrides: int) -> ARCBuffer:
    base = dict(capacity=4, ghost_capacity=4, p_init=2, max_insert=3, min_residency=0, warmup_events=0)
    base.update(overrides)
    return ARCBuffer(ARCConfig(**base))


def lists(buf: ARCBuffer) -> tuple[tuple[int, ...], ...]:
    return buf.t1, buf.t2, buf.b1, buf.b2


def state(
    t1: list[int],
    t2: list[int],
    b1: list[int],
    b2: list[int],
    p: float,
    *,
    clock: int = 0,
    events: int = 0,
    **overrides: int,
) -> ARCBuffer:
    """A buffer loaded from a hand-written snapshot (every resident id inserted at clock 0)."""
    buf = small(**overrides)
    buf.load_state_dict(
        {
            "version": 1,
            "config": asdict(buf.cfg),
            "p": p,
            "clock": clock,
            "events": events,
            "t1": [[t, 0] for t in t1],
            "t2": [[t, 0] for t in t2],
            "b1": b1,
            "b2": b2,
        }
    )
    return buf


def full_t1() -> ARCBuffer:
    """T1 = (1, 2, 3, 4), everything else empty, after two events."""
    buf = small()
    buf.admit([1, 2, 3])
    buf.admit([4])
    assert lists(buf) == ((1, 2, 3, 4), (), (), ())
    return buf


# -- defaults ------------------------------------------------------------------------------------
def test_defaults_follow_table_7() -> None:
    cfg = ARCConfig()
    assert (cfg.capacity, cfg.ghost_capacity, cfg.p_init) == (256, 256, 128)
    assert (cfg.max_insert, cfg.min_residency, cfg.warmup_events) == (32, 8, 50)
    buf = ARCBuffer()
    assert buf.p == 128.0 and len(buf) == 0 and buf.events == 0


def test_p_init_is_clamped_to_capacity() -> None:
    assert small(p_init=10).p == 4.0
    with pytest.raises(ValueError):
        ARCConfig(capacity=-1)


# -- misses, hits ----------------------------------------------------------------------------------
def test_misses_fill_t1_in_order() -> None:
    buf = small()
    res = buf.admit([1, 2, 3])
    assert res == AdmitResult(inserted=[1, 2, 3])
    assert lists(buf) == ((1, 2, 3), (), (), ())
    assert buf.ids() == [1, 2, 3] and len(buf) == 3 and 2 in buf and 4 not in buf
    assert buf.events == 1


def test_hit_moves_t1_to_t2_and_t2_to_mru() -> None:
    buf = small()
    buf.admit([1, 2, 3])
    assert buf.touch([2]) == 1
    assert lists(buf) == ((1, 3), (2,), (), ())
    res = buf.admit([3, 4])  # 3 is resident: a hit, not an insertion
    assert res.hits == [3] and res.inserted == [4]
    assert lists(buf) == ((1, 4), (2, 3), (), ())
    buf.touch([2])  # T2 hit: back to the MRU end
    assert lists(buf) == ((1, 4), (3, 2), (), ())
    assert buf.ids() == [1, 4, 3, 2]


def test_dedup_within_a_batch() -> None:
    buf = small(max_insert=2)
    res = buf.admit([7, 7, 8, 7])
    assert res == AdmitResult(inserted=[7, 8])  # the repeats are neither hits nor refusals
    assert lists(buf) == ((7, 8), (), (), ())


def test_touch_promotes_and_ignores_non_resident() -> None:
    buf = full_t1()
    buf.admit([5])  # evicts 1 into B1
    assert lists(buf) == ((2, 3, 4, 5), (), (1,), ())
    assert buf.touch([3, 1, 99, 3, 5]) == 2  # 1 is a ghost, 99 unknown, 3 counted once
    assert lists(buf) == ((2, 4), (3, 5), (1,), ())
    assert buf.p == 2.0 and len(buf) == 4


# -- replacement -----------------------------------------------------------------------------------
def test_evicts_lru_of_t1_while_t1_exceeds_p() -> None:
    buf = full_t1()
    res = buf.admit([5])
    assert res == AdmitResult(inserted=[5], evicted=[1])
    assert lists(buf) == ((2, 3, 4, 5), (), (1,), ())


def test_evicts_lru_of_t2_when_t1_is_at_most_p() -> None:
    buf = small()
    buf.admit([1, 2, 3])
    buf.touch([1, 2])
    buf.admit([4])
    assert lists(buf) == ((3, 4), (1, 2), (), ())
    res = buf.admit([5])  # |T1| = 2 = p, incoming is new -> T2 loses its LRU
    assert res.evicted == [1]
    assert lists(buf) == ((3, 4, 5), (2,), (), (1,))


def test_ghost_hit_in_b1_raises_p_and_enters_t2() -> None:
    buf = full_t1()
    buf.admit([5])
    res = buf.admit([1])  # B1 hit: p += max(|B2|/|B1|, 1) = max(0/1, 1) -> 3; |T1| = 4 > 3
    assert res == AdmitResult(inserted=[1], evicted=[2], ghost_hits=1)
    assert buf.p == 3.0
    assert lists(buf) == ((3, 4, 5), (1,), (2,), ())


def test_p_is_frozen_during_warmup_then_adapts() -> None:
    buf = small(warmup_events=4)
    buf.admit([1, 2, 3])  # event 1
    buf.admit([4])  # event 2
    buf.admit([5])  # event 3: evicts 1
    res = buf.admit([1])  # event 4, still warm-up: promoted, p stays 2; |T1| = 4 > 2
    assert res == AdmitResult(inserted=[1], evicted=[2], ghost_hits=1)
    assert buf.p == 2.0 and buf.events == 4
    assert lists(buf) == ((3, 4, 5), (1,), (2,), ())
    res = buf.admit([2])  # event 5: B1 hit, p -> 3; |T1| = 3 is not > 3 -> evict from T2
    assert res == AdmitResult(inserted=[2], evicted=[1], ghost_hits=1)
    assert buf.p == 3.0
    assert lists(buf) == ((3, 4, 5), (2,), (), (1,))
    res = buf.admit([1])  # event 6: B2 hit, p -= max(|B1|/|B2|, 1) = 1 -> 2; |T1| = 3 > 2
    assert res == AdmitResult(inserted=[1], evicted=[3], ghost_hits=1)
    assert buf.p == 2.0
    assert lists(buf) == ((4, 5), (2, 1), (3,), ())


def test_ghost_hit_steps_use_the_ghost_size_ratio() -> None:
    buf = state([10, 11], [20, 21], [30], [40, 41], p=1.0)
    buf.admit([30])  # p += |B2|/|B1| = 2 -> 3; |T1| = 2 is not > 3 -> evict T2's LRU
    assert buf.p == 3.0
    assert lists(buf) == ((10, 11), (21, 30), (), (40, 41, 20))

    buf = state([10, 11], [20, 21], [30, 31, 32], [40], p=3.0)
    buf.admit([40])  # p -= |B1|/|B2| = 3 -> 0; |T1| = 2 > 0 -> evict T1's LRU
    assert buf.p == 0.0
    assert lists(buf) == ((11,), (20, 21, 40), (30, 31, 32, 10), ())


def test_p_is_clamped_to_capacity_and_zero() -> None:
    buf = state([10, 11], [20, 21], [30], [40, 41, 42], p=3.5)
    buf.admit([30])  # 3.5 + 3 -> capped at 4
    assert buf.p == 4.0
    buf = state([10, 11], [20, 21], [30, 31, 32], [40], p=0.5)
    buf.admit([40])  # 0.5 - 3 -> floored at 0
    assert buf.p == 0.0


def test_b2_incoming_with_t1_equal_to_p_evicts_from_t1() -> None:
    # warm-up keeps p at 2, so the tie |T1| == p is exact
    buf = state([10, 11], [20, 21], [], [40], p=2.0, warmup_events=10)
    res = buf.admit([40])
    assert res.evicted == [10]
    assert lists(buf) == ((11,), (20, 21, 40), (10,), ())
    # the same tie with a new id or a B1 id evicts from T2
    buf = state([10, 11], [20, 21], [30], [], p=2.0, warmup_events=10)
    assert buf.admit([50]).evicted == [20]
    assert lists(buf) == ((10, 11, 50), (21,), (30,), (20,))
    buf = state([10, 11], [20, 21], [30], [], p=2.0, warmup_events=10)
    assert buf.admit([30]).evicted == [20]
    assert lists(buf) == ((10, 11), (21, 30), (), (20,))


def test_ghost_lists_are_capped_separately() -> None:
    buf = small(ghost_capacity=2)
    buf.admit([1, 2, 3])
    buf.admit([4])
    res = buf.admit([5, 6, 7])
    assert res.evicted == [1, 2, 3]
    assert lists(buf) == ((4, 5, 6, 7), (), (2, 3), ())  # 1 fell off B1
    assert buf.admit([1]).ghost_hits == 0  # forgotten: a plain miss again
    assert lists(buf) == ((5, 6, 7, 1), (), (3, 4), ())

    buf = small(ghost_capacity=0)
    buf.admit([1, 2, 3])
    buf.admit([4, 5])
    assert lists(buf) == ((2, 3, 4, 5), (), (), ())


# -- EvoSpec safeguards ------------------------------------------------------------------------------
def test_insertion_cap_refuses_the_rest_but_hits_still_count() -> None:
    buf = small(capacity=8)
    buf.admit([1, 2])
    res = buf.admit([3, 4, 5, 1, 6, 2])
    assert res == AdmitResult(inserted=[3, 4, 5], hits=[1, 2], refused=[6])
    assert lists(buf) == ((3, 4, 5), (1, 2), (), ())


def test_refused_ghost_leaves_everything_unchanged() -> None:
    buf = state([10, 11], [20, 21], [30, 31], [], p=2.0, max_insert=1)
    res = buf.admit([50, 30])  # 50 uses the only insertion (|T1| = 2 = p -> T2 evicts); 30 refused
    assert res == AdmitResult(inserted=[50], evicted=[20], refused=[30])
    assert buf.p == 2.0
    assert lists(buf) == ((10, 11, 50), (21,), (30, 31), (20,))


def test_residency_skips_young_lru_and_evicts_an_older_entry() -> None:
    buf = small(min_residency=2)
    buf.admit([1, 2])  # resident since clock 0
    buf.tick()
    buf.admit([3, 4])  # since clock 1
    buf.touch([3])
    buf.touch([1])
    buf.tick()  # clock 2: 1, 2 are 2 rounds old; 3, 4 only 1
    assert lists(buf) == ((2, 4), (3, 1), (), ())
    assert [buf.residency(t) for t in (1, 2, 3, 4, 5)] == [2, 2, 1, 1, None]
    res = buf.admit([5])  # |T1| = 2 = p -> T2; its LRU 3 is too young, 1 is old enough
    assert res.evicted == [1]
    assert lists(buf) == ((2, 4, 5), (3,), (), (1,))


def test_residency_falls_back_to_the_other_list() -> None:
    buf = small(min_residency=2)
    buf.admit([1, 2])
    buf.tick()
    buf.admit([3, 4])
    buf.touch([3, 4])
    buf.tick()
    assert lists(buf) == ((1, 2), (3, 4), (), ())
    res = buf.admit([5])  # T2 chosen, but 3 and 4 are 1 round old -> T1's LRU 1 (2 rounds)
    assert res.evicted == [1]
    assert lists(buf) == ((2, 5), (3, 4), (1,), ())


def test_residency_refuses_when_everything_is_young() -> None:
    buf = small(min_residency=2)
    buf.admit([1, 2, 3])
    buf.admit([4])
    buf.tick()  # everything is 1 round old
    res = buf.admit([5, 1])
    assert res == AdmitResult(hits=[1], refused=[5])
    assert lists(buf) == ((2, 3, 4), (1,), (), ())
    buf.tick()  # a promotion keeps the residency: 1 is 2 rounds old too
    assert buf.residency(1) == 2
    res = buf.admit([5])
    assert res == AdmitResult(inserted=[5], evicted=[2])
    assert lists(buf) == ((3, 4, 5), (1,), (2,), ())


def test_zero_capacity_refuses_everything() -> None:
    buf = small(capacity=0)
    assert buf.admit([1, 2]) == AdmitResult(refused=[1, 2])
    assert len(buf) == 0 and buf.p == 0.0


def test_accepts_tensors_and_rejects_negative_ids() -> None:
    import torch

    buf = small()
    assert buf.admit(torch.tensor([3, 1, 3])).inserted == [3, 1]
    with pytest.raises(ValueError):
        buf.admit([2, -1])


# -- persistence ---------------------------------------------------------------------------------------
def test_state_dict_round_trip_through_json() -> None:
    buf = small(min_residency=1, warmup_events=1)
    buf.admit([1, 2, 3])
    buf.tick()
    buf.admit([4])
    buf.touch([2])
    buf.tick()
    buf.admit([5])  # event 3: |T1| = 3 > 2 -> evict 1 (2 rounds old)
    sd = json.loads(json.dumps(buf.state_dict()))
    assert sd == {
        "version": 1,
        "config": dict(
            capacity=4, ghost_capacity=4, p_init=2, max_insert=3, min_residency=1, warmup_events=1
        ),
        "p": 2.0,
        "clock": 2,
        "events": 3,
        "t1": [[3, 0], [4, 1], [5, 2]],
        "t2": [[2, 0]],
        "b1": [1],
        "b2": [],
    }
    for restored in (ARCBuffer.from_state_dict(sd), small(min_residency=1, warmup_events=1)):
        restored.load_state_dict(sd)
        assert lists(restored) == ((3, 4, 5), (2,), (1,), ())
        assert (restored.p, restored.clock, restored.events) == (2.0, 2, 3)
        # behaves on from the snapshot: B1 hit after warm-up raises p to 3; |T1| = 3 is not > 3,
        # T2's 2 is old enough -> evicted
        res = restored.admit([1])
        assert res == AdmitResult(inserted=[1], evicted=[2], ghost_hits=1)
        assert lists(restored) == ((3, 4, 5), (1,), (), (2,))


def test_load_state_dict_rejects_bad_snapshots() -> None:
    good = small().state_dict()
    bad: list[dict[str, Any]] = [
        {**good, "version": 2},
        {**good, "config": {**good["config"], "capacity": 5}},
        {**good, "t1": [[1, 0]], "b1": [1]},  # overlap
        {**good, "t1": [[1, 0], [2, 0], [3, 0]], "t2": [[4, 0], [5, 0]]},  # over capacity
        {**good, "b2": [1, 2, 3, 4, 5]},  # over ghost capacity
        {**good, "p": 4.5},
        {**good, "t1": [[1, 3]]},  # inserted after the clock
    ]
    buf = small()
    buf.admit([9])
    for sd in bad:
        with pytest.raises(ValueError):
            buf.load_state_dict(sd)
    assert lists(buf) == ((9,), (), (), ())


def test_reset() -> None:
    buf = full_t1()
    buf.admit([5])
    buf.tick()
    buf.reset()
    assert lists(buf) == ((), (), (), ())
    assert (buf.p, buf.clock, buf.events) == (2.0, 0, 0)


# -- random invariants -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    cfg = ARCConfig(
        capacity=rng.randint(1, 12),
        ghost_capacity=rng.randint(0, 12),
        p_init=rng.randint(0, 14),
        max_insert=rng.randint(1, 6),
        min_residency=rng.randint(0, 3),
        warmup_events=rng.randint(0, 10),
    )
    buf = ARCBuffer(cfg)
    for _ in range(600):
        op = rng.random()
        if op < 0.25:
            buf.tick()
        elif op < 0.45:
            buf.touch([rng.randrange(30) for _ in range(rng.randint(0, 6))])
        else:
            batch = [rng.randrange(30) for _ in range(rng.randint(0, 10))]
            before = {t: buf.residency(t) for t in buf.ids()}
            res = buf.admit(batch)
            distinct = list(dict.fromkeys(batch))
            assert sorted(res.inserted + res.hits + res.refused) == sorted(distinct)
            assert len(res.inserted) <= cfg.max_insert and res.ghost_hits <= len(res.inserted)
            # an id inserted earlier in this same batch is 0 rounds old
            assert all((before.get(t) or 0) >= cfg.min_residency for t in res.evicted)
        t1, t2, b1, b2 = map(set, lists(buf))
        assert len(t1) + len(t2) <= cfg.capacity
        assert len(b1) <= cfg.ghost_capacity and len(b2) <= cfg.ghost_capacity
        assert len(t1 | t2 | b1 | b2) == len(t1) + len(t2) + len(b1) + len(b2)
        assert 0.0 <= buf.p <= cfg.capacity

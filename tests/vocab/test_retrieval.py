"""Retrieval: priority order and dedup; the pool never blocks and reports late, failed, dropped work."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import numpy as np

from evospec.vocab.retrieval import IndexRetriever, RetrievalPool


class _Hnsw:
    def search(self, h, k):
        return np.array([[7, 3, 9][:k]])


class _Graph:
    succ: ClassVar[dict[int, list[int]]] = {5: [6, 7], 3: [4], 7: [8, 5], 9: []}

    def successors(self, u, k):
        return np.array(self.succ.get(u, [])[:k], dtype=np.int64)


def test_seeds_then_graph_successors_deduplicated_in_priority_order():
    r = IndexRetriever(_Hnsw(), _Graph(), n_sem=3, per_seed=2)
    # seeds: target top [5, 3] then HNSW [7, 3, 9] -> 5, 3, 7, 9; successors 6, 7 | 4 | 8, 5 | -
    assert r(np.array([5, 3]), np.zeros(4, np.float32)) == [5, 3, 7, 9, 6, 4, 8]


def test_retriever_without_indices_returns_the_target_top_ids():
    assert IndexRetriever(None, None)(np.array([4, 2]), np.zeros(3)) == [4, 2]


def test_synchronous_pool_result_merges_next_round_not_late():
    pool = RetrievalPool(lambda top, h: [int(top[0]) + 1], synchronous=True)
    assert pool.submit(3, np.array([10]), np.zeros(2))
    (res,) = pool.poll(4)
    assert res.ids == [11] and not res.late and res.error is None and res.latency_s >= 0
    assert pool.poll(5) == []


def test_result_merged_after_its_round_is_late():
    pool = RetrievalPool(lambda top, h: [1], synchronous=True)
    pool.submit(2, np.array([0]), np.zeros(1))
    (res,) = pool.poll(6)
    assert res.late


def test_raising_retriever_is_reported_not_raised():
    def boom(top, h):
        raise RuntimeError("index gone")

    pool = RetrievalPool(boom)
    pool.submit(0, np.array([0]), np.zeros(1))
    deadline = time.time() + 5
    out = []
    while not out and time.time() < deadline:
        out = pool.poll(1)
    assert isinstance(out[0].error, RuntimeError) and out[0].ids == []
    pool.close()


def test_stalled_worker_bounds_pending_and_drops_new_events():
    gate = threading.Event()

    def stall(top, h):
        gate.wait(5)
        return [1]

    pool = RetrievalPool(stall, max_pending=2)
    assert pool.submit(0, np.array([0]), np.zeros(1))
    assert pool.submit(1, np.array([0]), np.zeros(1))
    assert not pool.submit(2, np.array([0]), np.zeros(1))  # saturated: dropped, never queued
    assert pool.poll(3) == []  # polling never waits
    gate.set()
    pool.close()


def test_results_of_a_previous_request_are_discarded():
    pool = RetrievalPool(lambda top, h: [1], synchronous=True)
    pool.submit(0, np.array([0]), np.zeros(1))
    pool.reset()
    assert pool.poll(1) == []

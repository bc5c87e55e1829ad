"""Asynchronous vocabulary retrieval on a CPU worker: EvoSpec's Path A.

Owns: :class:`IndexRetriever` (one OOV event -> candidate ids: the target's top ids at the
rejected position, the HNSW inner-product neighbours of the target hidden state there, then
bigram-graph successors of every seed, deduplicated in that priority order) and
:class:`RetrievalPool` (a worker thread that runs retrievals beside the decode loop).

Contract with the decode loop: :meth:`RetrievalPool.submit` never waits; :meth:`RetrievalPool.poll`
returns only results that are already finished (the caller polls at each round's first draft
LM-head call). A result is *late* when it was not ready at that point of the round right after
its event (round ``event + 1``) and merged into a later one. A retriever that raises yields
a result with ``error`` set (counted, never merged); one that stalls keeps its slot, and
once ``max_pending`` events are in flight new events are dropped (counted) instead of
queueing without bound. None of this can change the output:
verification always runs over the target's full vocabulary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

Retriever = Callable[[np.ndarray, np.ndarray], list[int]]  # (top ids [k], hidden [D]) -> ids


class IndexRetriever:
    """Seeds = target top ids ∪ HNSW top-``n_sem`` neighbours; then ``per_seed`` graph successors."""

    def __init__(self, hnsw, graph, *, n_sem: int = 10, per_seed: int = 8) -> None:
        self.hnsw = hnsw  # indices.hnsw.LMHeadIndex (search(h [n, D], k) -> ids [n, k]) or None
        self.graph = graph  # indices.bigram.BigramGraph (successors(u, k) -> ids) or None
        self.n_sem = n_sem
        self.per_seed = per_seed

    def __call__(self, top_ids: np.ndarray, hidden: np.ndarray) -> list[int]:
        seeds = [int(i) for i in top_ids]
        if self.hnsw is not None and self.n_sem > 0:
            seeds += [int(i) for i in self.hnsw.search(hidden[None].astype(np.float32), self.n_sem)[0]]
        seeds = list(dict.fromkeys(seeds))
        out = list(seeds)
        if self.graph is not None and self.per_seed > 0:
            for s in seeds:
                out.extend(int(v) for v in self.graph.successors(s, self.per_seed))
        return list(dict.fromkeys(out))


@dataclass
class RetrievalResult:
    event_round: int  # round whose verification raised the OOV event
    ids: list[int]  # candidates in priority order (empty on error)
    latency_s: float  # worker time from submit to finish
    late: bool  # missed round event_round + 1
    error: BaseException | None = None


@dataclass
class _Pending:
    event_round: int
    future: Future
    submitted: float
    finished: list[float]  # set by the worker: [finish time]
    generation: int  # request generation it belongs to (older ones are discarded when done)


class RetrievalPool:
    """One worker thread (``synchronous=True`` runs retrievals inline, for deterministic tests)."""

    def __init__(self, retriever: Retriever, *, max_pending: int = 4, synchronous: bool = False) -> None:
        self.retriever = retriever
        self.max_pending = max_pending
        self.synchronous = synchronous
        self._pool = None if synchronous else ThreadPoolExecutor(1, thread_name_prefix="evospec-retrieval")
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._generation = 0

    def _run(self, top_ids: np.ndarray, hidden: np.ndarray, finished: list[float]) -> list[int]:
        try:
            return self.retriever(top_ids, hidden)
        finally:
            finished.append(time.perf_counter())

    def submit(self, event_round: int, top_ids: np.ndarray, hidden: np.ndarray) -> bool:
        """Queue one retrieval; False (dropped) when ``max_pending`` are still running."""
        with self._lock:
            if len(self._pending) >= self.max_pending:
                return False
            finished: list[float] = []
            now = time.perf_counter()
            if self._pool is None:
                fut: Future = Future()
                try:
                    fut.set_result(self._run(top_ids, hidden, finished))
                except Exception as exc:  # reported through the result, never raised into the loop
                    fut.set_exception(exc)
            else:
                fut = self._pool.submit(self._run, top_ids, hidden, finished)
            self._pending.append(_Pending(event_round, fut, now, finished, self._generation))
            return True

    def poll(self, round_index: int) -> list[RetrievalResult]:
        """Finished results, oldest first, for the round about to start (never waits)."""
        with self._lock:
            done = [p for p in self._pending if p.future.done()]
            self._pending = [p for p in self._pending if not p.future.done()]
        out = []
        for p in done:
            if p.generation != self._generation:
                continue
            latency = (p.finished[0] if p.finished else time.perf_counter()) - p.submitted
            late = round_index > p.event_round + 1
            exc = p.future.exception()
            ids = [] if exc is not None else p.future.result()
            out.append(RetrievalResult(p.event_round, ids, latency, late, exc))
        return out

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def reset(self) -> None:
        """New request: in-flight work of the previous one is discarded when it finishes (it
        still counts against ``max_pending`` until then, so a stalled worker stays bounded)."""
        with self._lock:
            self._generation += 1

    def close(self) -> None:
        with self._lock:
            self._pending = []
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

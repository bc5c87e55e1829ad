"""Bigram successor graph: exact counts and pruning on a hand-written corpus, no pairs across
documents, chunked streaming equals one pass, look-ups and save/load."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from indices.bigram import BigramGraph, BigramParams, PairCounter

V = 8
DOCS = [
    [0, 1, 0, 1, 0, 2, 0, 3],  # (0,1)x2 (1,0)x2 (0,2) (2,0) (0,3)
    [0, 1, 0, 2, 5],  # (0,1) (1,0) (0,2) (2,5)
    [0, 4, 0, 4],  # (0,4)x2 (4,0)
    [2],  # no pair
    [3, 6, 3, 6, 3, 6],  # (3,6)x3 (6,3)x2
]
# count(u, v) by hand; the documents' boundaries (3->0, 5->0, 4->2, 2->3) are not pairs.
PAIRS = {
    (0, 1): 3,
    (0, 2): 2,
    (0, 3): 1,
    (0, 4): 2,
    (1, 0): 3,
    (2, 0): 1,
    (2, 5): 1,
    (3, 6): 3,
    (4, 0): 1,
    (6, 3): 2,
}


def _rows(graph: BigramGraph) -> dict[int, list[tuple[int, float]]]:
    return {
        u: list(zip(graph.successors(u, 99).tolist(), graph.probs(u).tolist(), strict=True))
        for u in range(graph.vocab_size)
        if graph.degree(u)
    }


def test_pair_counts_exact_and_never_across_documents() -> None:
    counter = PairCounter(V)
    for d in DOCS:
        counter.add(np.array(d))
    coo = counter.counts.tocoo()
    got = {(int(u), int(v)): int(n) for u, v, n in zip(coo.row, coo.col, coo.data, strict=True)}
    assert got == PAIRS
    for u, v in [(3, 0), (5, 0), (4, 2), (2, 3)]:  # would exist if documents were concatenated
        assert counter.counts[u, v] == 0


def test_prune_by_count_prob_and_degree() -> None:
    # row 0: total 8 -> p(1)=3/8, p(2)=2/8, p(3)=1/8, p(4)=2/8; 2 and 4 tie, the lower id wins.
    g = BigramGraph.from_sequences(DOCS, V, BigramParams(min_count=2, min_prob=0.25, max_degree=2))
    assert _rows(g) == {0: [(1, 0.375), (2, 0.25)], 1: [(0, 1.0)], 3: [(6, 1.0)], 6: [(3, 1.0)]}
    assert g.num_edges == 5
    # a larger degree keeps the tie partner 4; (0,3) still fails count and prob.
    g = BigramGraph.from_sequences(DOCS, V, BigramParams(min_count=2, min_prob=0.25, max_degree=3))
    assert _rows(g)[0] == [(1, 0.375), (2, 0.25), (4, 0.25)]


def test_prune_by_prob_alone() -> None:
    # min_count 1: (0,3) passes the count but p = 1/8 < 0.25; rows 2 and 4 now survive.
    g = BigramGraph.from_sequences(DOCS, V, BigramParams(min_count=1, min_prob=0.25, max_degree=2))
    assert _rows(g) == {
        0: [(1, 0.375), (2, 0.25)],
        1: [(0, 1.0)],
        2: [(0, 0.5), (5, 0.5)],
        3: [(6, 1.0)],
        4: [(0, 1.0)],
        6: [(3, 1.0)],
    }
    g = BigramGraph.from_sequences(DOCS, V, BigramParams(min_count=1, min_prob=0.1, max_degree=64))
    assert [v for v, _ in _rows(g)[0]] == [1, 2, 4, 3]  # p desc, then id asc


def test_successors_many_in_seed_order() -> None:
    g = BigramGraph.from_sequences(DOCS, V, BigramParams(min_count=1, min_prob=0.1, max_degree=64))
    assert g.successors(0, 2).tolist() == [1, 2]
    assert g.successors(7, 5).tolist() == []
    assert g.successors_many([2, 7, 0, 1], 2).tolist() == [0, 5, 1, 2, 0]
    assert g.successors_many([0, 0], 1).tolist() == [1, 1]  # not deduplicated
    assert g.successors_many([], 3).tolist() == []
    assert g.successors_many([0, 1], 0).tolist() == []
    assert g.successors_many(np.array([3]), 8).dtype == np.int64


def _brute_force(docs: list[np.ndarray], vocab: int, p: BigramParams) -> dict[int, list[int]]:
    pairs = Counter((int(a), int(b)) for d in docs for a, b in itertools.pairwise(d))
    totals = Counter()
    for (u, _), n in pairs.items():
        totals[u] += n
    rows: dict[int, list[int]] = {}
    for u in sorted(totals):
        cand = [
            (-n, v)
            for (a, v), n in pairs.items()
            if a == u and n >= p.min_count and n / totals[u] >= p.min_prob
        ]
        if cand:
            rows[u] = [v for _, v in sorted(cand)[: p.max_degree]]
    return rows


@pytest.mark.parametrize("vocab", [50, 262_144])
def test_chunked_stream_matches_brute_force(vocab: int) -> None:
    rng = np.random.default_rng(0)
    hot = rng.choice(vocab, size=12, replace=False)  # a small hot set so edges pass min_count
    docs = [hot[rng.integers(0, 12, size=rng.integers(1, 30))] for _ in range(400)]
    params = BigramParams(min_count=3, min_prob=0.05, max_degree=4)
    counter = PairCounter(vocab, chunk_pairs=97)  # many partial reductions
    for d in docs:
        counter.add(d)
    g = BigramGraph.from_counts(counter.counts, params)
    assert {u: g.successors(u, 99).tolist() for u in range(vocab) if g.degree(u)} == _brute_force(
        docs, vocab, params
    )
    assert np.all(np.diff(g.data[g.indptr[hot[0]] : g.indptr[hot[0] + 1]]) <= 0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    params = BigramParams(min_count=1, min_prob=0.1, max_degree=3)
    g = BigramGraph.from_sequences(DOCS, V, params)
    g.save(tmp_path / "g.npz")
    h = BigramGraph.load(tmp_path / "g.npz")
    assert h.params == params and h.vocab_size == V
    assert np.array_equal(h.indptr, g.indptr) and np.array_equal(h.indices, g.indices)
    assert np.array_equal(h.data, g.data) and h.data.dtype == np.float32


def test_out_of_range_ids_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        PairCounter(V).add(np.array([0, V]))

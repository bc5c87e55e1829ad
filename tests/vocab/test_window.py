"""Candidate window: hand-written streams, pushes wider than the window, a brute-force check."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from evospec.vocab.window import EMPTY, CandidateWindow


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def active(win: CandidateWindow) -> set[int]:
    return set(win.active_ids().tolist())


def test_window_of_five_over_three_pushes() -> None:
    win = CandidateWindow(vocab_size=10, w_max=5)
    assert active(win) == set() and win.size == 0
    win.push(ids(1, 2, 3))
    win.push(ids(3, 4))  # stream 1 2 3 3 4: exactly full
    assert active(win) == {1, 2, 3, 4}
    assert win.counts.tolist() == [0, 1, 1, 2, 1, 0, 0, 0, 0, 0]
    win.push(ids(5, 6))  # stream 1 2 3 3 4 5 6 -> last five: 3 3 4 5 6
    assert active(win) == {3, 4, 5, 6}
    assert win.counts.tolist() == [0, 0, 0, 2, 1, 1, 1, 0, 0, 0]
    assert win.stream_length == 7 and win.size == 4
    win.push(ids(7))  # last five: 3 4 5 6 7 -- one 3 is still inside
    assert active(win) == {3, 4, 5, 6, 7} and win.counts[3] == 1
    win.push(ids(7))  # last five: 4 5 6 7 7
    assert active(win) == {4, 5, 6, 7} and win.counts[7] == 2
    mask = win.active_mask()
    assert mask.dtype == torch.bool and mask.shape == (10,)
    assert mask.tolist() == [False] * 4 + [True] * 4 + [False] * 2


def test_duplicates_inside_one_push() -> None:
    win = CandidateWindow(vocab_size=6, w_max=4)
    win.push(ids(2, 2, 2, 5))
    assert win.counts.tolist() == [0, 0, 3, 0, 0, 1]
    win.push(ids(1, 1))  # last four: 2 5 1 1
    assert win.counts.tolist() == [0, 2, 1, 0, 0, 1]
    assert win.active_ids().tolist() == [1, 2, 5]


def test_push_wider_than_the_window() -> None:
    win = CandidateWindow(vocab_size=10, w_max=4)
    win.push(ids(9, 9))
    win.push(ids(1, 2, 3, 4, 5, 6, 2))  # last four of the stream: 4 5 6 2
    assert active(win) == {2, 4, 5, 6} and win.counts[9] == 0 and win.counts[2] == 1
    assert win.stream_length == 9
    win.push(ids(7))  # 5 6 2 7
    assert active(win) == {2, 5, 6, 7}
    win.push(ids(1, 1, 1, 1, 1, 2))  # 1 1 1 2
    assert win.counts.tolist() == [0, 3, 1, 0, 0, 0, 0, 0, 0, 0]
    win.push(ids(8, 8, 8, 8))  # exactly w_max: the whole window is replaced
    assert win.counts.tolist() == [0] * 8 + [4, 0]
    assert win.ring.tolist() == [8, 8, 8, 8]


def test_empty_push_reset_and_bad_input() -> None:
    win = CandidateWindow(vocab_size=5, w_max=3)
    win.push(ids())
    assert win.stream_length == 0 and win.ring.tolist() == [EMPTY] * 3
    win.push(ids(4, 0))
    win.reset()
    assert win.stream_length == 0 and win.size == 0 and win.ring.tolist() == [EMPTY] * 3
    win.push(torch.tensor([3], dtype=torch.int32))  # any integer dtype is taken
    assert active(win) == {3}
    with pytest.raises(ValueError):
        win.push(torch.tensor([[1, 2]]))
    with pytest.raises(ValueError):
        CandidateWindow(vocab_size=5, w_max=0)


def brute_force_check(device: str, seed: int) -> None:
    rng = random.Random(seed)
    vocab, w_max = 40, 23
    win = CandidateWindow(vocab, w_max, device=device)
    stream: list[int] = []
    for _ in range(120):
        n = rng.choice([0, 1, 3, w_max - 1, w_max, w_max + 1, rng.randint(0, 3 * w_max)])
        batch = [rng.randrange(vocab) for _ in range(n)]
        win.push(torch.tensor(batch, dtype=torch.int64, device=device))
        stream += batch
        tail = Counter(stream[-w_max:])
        assert win.counts.tolist() == [tail[i] for i in range(vocab)]
        assert win.active_ids().tolist() == sorted(tail)
        assert win.active_mask().tolist() == [i in tail for i in range(vocab)]
        assert win.stream_length == len(stream)


@pytest.mark.parametrize("seed", range(3))
def test_matches_brute_force_suffix_unique(seed: int) -> None:
    brute_force_check("cpu", seed)


@pytest.mark.gpu
def test_push_on_cuda_matches_and_does_not_sync() -> None:
    brute_force_check("cuda", 0)
    win = CandidateWindow(1000, w_max=64, device="cuda")
    batch = torch.randint(0, 1000, (100,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            win.push(batch[:37])
            win.push(batch)
            win.active_mask()
    finally:
        torch.cuda.set_sync_debug_mode("default")

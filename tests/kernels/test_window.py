"""Window push: the torch reference against a brute-force stream, padded pushes through
``CandidateWindow``, ``unique_padded``, the interpreted kernel, and the compiled one on CUDA."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from evospec.kernels.window import PAD, unique_padded, window_push, window_push_torch
from evospec.vocab.window import CandidateWindow
from tests.kernels.interp_cases import CASES


def _state(vocab: int, w_max: int, device: str = "cpu") -> list[torch.Tensor]:
    return [
        torch.full((w_max,), -1, dtype=torch.int64, device=device),
        torch.zeros(vocab, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
    ]


def _random_pushes(seed: int, vocab: int, w_max: int, rounds: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(rounds):
        n = rng.choice([0, 1, w_max - 1, w_max, w_max + 1, rng.randint(0, 3 * w_max)])
        out.append([rng.randrange(-3, vocab) for _ in range(n)])  # about 3 in vocab+3 are padding
    return out


@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_suffix_of_the_stream(seed: int) -> None:
    vocab, w_max = 30, 11
    ring, counts, head = _state(vocab, w_max)
    stream: list[int] = []
    for batch in _random_pushes(seed, vocab, w_max, 60):
        window_push_torch(ring, counts, head, torch.tensor(batch, dtype=torch.int64))
        stream += [t for t in batch if t >= 0]
        tail = Counter(stream[-w_max:])
        assert counts.tolist() == [tail[i] for i in range(vocab)]
        assert int(head) == len(stream)
        expect_ring = [-1] * w_max
        for g in range(max(0, len(stream) - w_max), len(stream)):
            expect_ring[g % w_max] = stream[g]
        assert ring.tolist() == expect_ring


def test_unique_padded_keeps_torch_unique_order() -> None:
    ids = torch.tensor([5, 3, 5, 9, 3, 3, 0])
    out = unique_padded(ids)
    assert out.shape == ids.shape
    assert out[out != PAD].tolist() == torch.unique(ids).tolist() == [0, 3, 5, 9]
    assert unique_padded(torch.tensor([], dtype=torch.long)).numel() == 0


@pytest.mark.parametrize("seed", range(2))
def test_padded_push_equals_plain_push_of_the_valid_entries(seed: int) -> None:
    vocab, w_max = 25, 9
    plain = CandidateWindow(vocab, w_max)
    padded = CandidateWindow(vocab, w_max)
    for i, batch in enumerate(_random_pushes(seed, vocab, w_max, 40)):
        ids = torch.tensor(batch, dtype=torch.int64)
        plain.push(ids[ids >= 0])
        if i % 3 == 0:  # mixing plain pushes into a window whose length lives on the device
            padded.push(ids[ids >= 0])
        else:
            padded.push_padded(ids)
        assert torch.equal(plain.ring, padded.ring) and torch.equal(plain.counts, padded.counts)
        assert padded.stream_length == plain.stream_length
    padded.reset()
    assert padded.stream_length == 0 and padded.size == 0


def test_nanospec_round_through_unique_padded_matches_torch_unique() -> None:
    tree = torch.tensor([4, 7, 7, 2, 9, 2, 4])  # node 0 is the root
    ver = torch.tensor([7, 1, 1, 3])
    a, b = CandidateWindow(12, 6), CandidateWindow(12, 6)
    a.push(torch.cat([torch.unique(tree[1:]), ver]))
    b.push_padded(torch.cat([unique_padded(tree[1:]), ver]))
    assert torch.equal(a.ring, b.ring) and torch.equal(a.counts, b.counts)
    assert a.active_ids().tolist() == [1, 3, 7, 9]  # last six of 2 4 7 9 7 1 1 3


def test_bad_state_is_rejected() -> None:
    ring, counts, head = _state(5, 3)
    with pytest.raises(ValueError):
        window_push(ring, counts.long(), head, torch.tensor([1]))
    with pytest.raises(ValueError):
        window_push(ring, counts, head, torch.tensor([[1]]))
    with pytest.raises(ValueError):
        CandidateWindow(5, 3).push_padded(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("window")])
def test_interpreted_kernel_equals_reference(interpreted: dict[str, str], name: str) -> None:
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.gpu
def test_compiled_kernel_equals_reference_and_does_not_sync() -> None:
    vocab, w_max = 128256, 3072
    got, ref = _state(vocab, w_max, "cuda"), _state(vocab, w_max, "cuda")
    pushes = [torch.tensor(b, dtype=torch.int64) for b in _random_pushes(0, vocab, w_max, 30)]
    pushes = [p.cuda() for p in pushes]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ids in pushes:
            window_push(*got, ids, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for ids in pushes:
        window_push_torch(*ref, ids)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_candidate_window_padded_round_on_cuda_does_not_sync() -> None:
    win = CandidateWindow(128256, w_max=3072, device="cuda")
    tree = torch.randint(0, 128256, (61,), device="cuda")
    ver = torch.randint(0, 128256, (6 * 3,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            win.push_padded(torch.cat([unique_padded(tree[1:]), ver]))
            win.active_mask()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert win.stream_length > 0

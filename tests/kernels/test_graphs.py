"""Bucketed CUDA graphs: bucket choice, the eager fallback off CUDA, capture equals eager on CUDA."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.graphs import BucketGraphs, bucket_for


def test_bucket_for_picks_the_smallest_that_fits() -> None:
    assert bucket_for(1, [4, 8, 16]) == 4
    assert bucket_for(8, [4, 8, 16]) == 8
    assert bucket_for(9, [4, 8, 16]) == 16
    assert bucket_for(17, [4, 8, 16]) is None


def _head_fn(weight: torch.Tensor, k: int):
    def fn(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
        top = torch.topk(logp, k, dim=-1)
        return top.values, top.indices

    return fn


def test_cpu_runs_eagerly_with_identical_results() -> None:
    weight = torch.randn(50, 8)
    fn = _head_fn(weight, 3)
    graphs = BucketGraphs(fn, [4, 16])
    assert not graphs.enabled or torch.cuda.is_available()
    for n in (1, 4, 5, 20):
        hidden = torch.randn(n, 8)
        got, ref = graphs(hidden), fn(hidden)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert graphs.replays == 0 and graphs.eager_calls == 4 and not graphs.graphs


def test_inputs_must_share_the_bucketed_dimension_and_buckets_be_positive() -> None:
    graphs = BucketGraphs(lambda a, b: a + b, [4], enabled=False)
    with pytest.raises(ValueError):
        graphs(torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError):
        BucketGraphs(lambda a: a, [0, 4])


@pytest.mark.gpu
def test_replay_equals_eager_across_buckets_and_new_contents() -> None:
    weight = torch.randn(32000, 512, device="cuda", dtype=torch.float16)
    fn = _head_fn(weight, 8)
    graphs = BucketGraphs(fn, [1, 8, 64])
    for n in (1, 3, 8, 40, 64, 3):
        hidden = torch.randn(n, 512, device="cuda", dtype=torch.float16)
        got, ref = graphs(hidden), fn(hidden)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0])
    assert set(graphs.graphs) == {1, 8, 64} and not graphs.failed
    assert graphs.replays == 6
    big = torch.randn(65, 512, device="cuda", dtype=torch.float16)
    assert torch.equal(graphs(big)[1], fn(big)[1]) and graphs.eager_calls == 1

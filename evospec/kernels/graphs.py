"""CUDA-graph replay of a row-wise function at fixed bucket sizes, with an eager CPU fallback.

Owns: :class:`BucketGraphs`, which captures ``fn(*inputs)`` once per bucket size of the
inputs' leading dimension (e.g. the draft step's frontier width, the verify forward's tree
size), then serves a call of ``n`` rows by copying the inputs into the smallest bucket's
static buffers, replaying that bucket's graph and returning the first ``n`` output rows.
It does not know what ``fn`` computes.

Contract on ``fn``: every input and output has the bucketed dimension first; output row i
depends only on input row i (padding rows are zeros and never leak into real rows); ``fn``
reads any other state (weights, packed head rows, bias) from tensors whose addresses do not
change between calls -- a graph replays the addresses it captured. Functions that write a KV
cache at a host-side offset do not meet this contract (the offset would be frozen into the
graph); they need a device-side write index first.

Off CUDA, with ``enabled=False``, for ``n`` above the largest bucket, or if a capture raises,
the call runs ``fn`` eagerly -- the result is the same, only slower.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (buckets ascending), or None when n exceeds them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static input buffers, [bucket, ...] each
    outputs: tuple[torch.Tensor, ...]  # static outputs, [bucket, ...] each
    single: bool  # fn returned one tensor, not a tuple


class BucketGraphs:
    """``fn`` replayed from CUDA graphs captured at the given leading-dimension buckets."""

    def __init__(
        self,
        fn: Callable[..., Outputs],
        buckets: Sequence[int],
        *,
        enabled: bool | None = None,
        warmup: int = 2,
        clone_outputs: bool = True,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive sizes, got {list(buckets)}")
        self.fn = fn
        self.buckets = sorted(set(buckets))
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self.warmup = warmup
        self.clone_outputs = clone_outputs  # False: views into static buffers, valid until the next call
        self.graphs: dict[int, _Captured] = {}
        self.failed: dict[int, str] = {}  # bucket -> why its capture fell back to eager
        self.eager_calls = 0
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor) -> Outputs:
        n = inputs[0].shape[0]
        if any(x.shape[0] != n for x in inputs):
            raise ValueError("all inputs must share the leading (bucketed) dimension")
        bucket = bucket_for(n, self.buckets)
        if not self.enabled or bucket is None or bucket in self.failed or not inputs[0].is_cuda:
            self.eager_calls += 1
            return self.fn(*inputs)
        cap = self.graphs.get(bucket)
        if cap is None:
            cap = self._capture(bucket, inputs)
            if cap is None:
                self.eager_calls += 1
                return self.fn(*inputs)
        for buf, x in zip(cap.inputs, inputs, strict=True):
            buf[:n].copy_(x)
            if n < bucket:
                buf[n:].zero_()
        cap.graph.replay()
        self.replays += 1
        outs = tuple(o[:n].clone() if self.clone_outputs else o[:n] for o in cap.outputs)
        return outs[0] if cap.single else outs

    def _capture(self, bucket: int, inputs: Sequence[torch.Tensor]) -> _Captured | None:
        static = tuple(torch.zeros((bucket, *x.shape[1:]), dtype=x.dtype, device=x.device) for x in inputs)
        for buf, x in zip(static, inputs, strict=True):
            buf[: x.shape[0]].copy_(x)
        try:
            side = torch.cuda.Stream(device=static[0].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph (allocations, autotuning)
                for _ in range(self.warmup):
                    self.fn(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.fn(*static)
        except Exception as exc:  # a capture-unsafe op: remember and run eagerly
            self.failed[bucket] = f"{type(exc).__name__}: {exc}"
            return None
        single = isinstance(out, torch.Tensor)
        outputs = (out,) if single else tuple(out)
        cap = _Captured(graph, static, outputs, single)
        self.graphs[bucket] = cap
        return cap

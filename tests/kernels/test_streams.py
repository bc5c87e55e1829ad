"""Streams and events: no-ops off CUDA; on CUDA a copy stream per device and real priorities."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.streams import (
    copy_stream,
    follow_current,
    on_stream,
    record_event,
    side_stream,
    wait_event,
)


def test_cpu_gets_no_streams_and_the_verbs_do_nothing() -> None:
    assert copy_stream("cpu") is None
    assert side_stream("cpu", priority="low") is None
    assert record_event(None) is None
    x = torch.zeros(3)
    follow_current(None, x)
    wait_event(None)
    with on_stream(None):
        x += 1  # runs inline, in program order
    assert x.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.gpu
def test_cuda_streams_events_and_priorities() -> None:
    s = copy_stream("cuda")
    assert s is not None and copy_stream("cuda:0") is s
    low, high = side_stream("cuda", "low"), side_stream("cuda", "high")
    assert low is not None and high is not None and high.priority < low.priority
    x = torch.randn(4096, 4096, device="cuda")
    follow_current(s, x)
    with on_stream(s):
        y = x * 2
    ev = record_event(s)
    wait_event(ev)  # the current stream now orders after y
    assert torch.equal(y, x * 2)

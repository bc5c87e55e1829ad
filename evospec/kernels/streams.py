"""CUDA streams and events for overlapping work, with no-op stand-ins on the CPU.

Owns: the per-device copy stream (LM-head row gathers run there, beside the draft backbone on
the compute stream), side streams of a chosen priority (the asynchronous LoRA updater's), and
the two event verbs the pipeline needs: record on a stream, make the current stream wait.
Waiting is stream-to-stream on the device; nothing here blocks the host. On a CPU (or when a
tensor is not on CUDA) every factory returns ``None`` and every verb does nothing, so callers
keep one code path: work that would go to a stream simply runs inline, in program order.

Priorities: CUDA numbers them from 0 (least, which is also the default stream's) down to a
negative greatest. ``"low"`` gives 0 -- the same as the default stream, so work there yields
only to streams made with ``"high"``; ``"high"`` gives the greatest priority.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch

Priority = Literal["low", "normal", "high"]

_COPY: dict[torch.device, torch.cuda.Stream] = {}


def _cuda_device(device: torch.device | str | None) -> torch.device | None:
    """The CUDA device meant by ``device`` (None: the current one), or None when not CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        return None
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def copy_stream(device: torch.device | str | None) -> torch.cuda.Stream | None:
    """The device's gather stream (one per device, created once); None off CUDA."""
    dev = _cuda_device(device)
    if dev is None:
        return None
    if dev not in _COPY:
        _COPY[dev] = torch.cuda.Stream(device=dev)
    return _COPY[dev]


def side_stream(
    device: torch.device | str | None = None, priority: Priority = "low"
) -> torch.cuda.Stream | None:
    """A new stream of ``priority`` on ``device`` (e.g. for LoRA updates); None off CUDA."""
    dev = _cuda_device(device)
    if dev is None:
        return None
    least, greatest = torch.cuda.Stream.priority_range()
    level = {"low": least, "normal": least, "high": greatest}[priority]
    return torch.cuda.Stream(device=dev, priority=level)


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """Context that makes ``stream`` current (nothing when None)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def follow_current(stream: torch.cuda.Stream | None, *tensors: torch.Tensor) -> None:
    """Order ``stream`` after the work queued so far on the current stream, and tell the caching
    allocator that ``tensors`` (made on the current stream) are used on ``stream`` too."""
    if stream is None:
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)


def record_event(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event marking the work queued so far on ``stream``; None when ``stream`` is None."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(event: torch.cuda.Event | None) -> None:
    """Make the current stream wait for ``event`` (device-side; the host does not block)."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)

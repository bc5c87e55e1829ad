"""What flows through the engine thread (``service/engine.py``) and back to the handlers.

Owns: :class:`GenerationRequest` (one typed unit of work, with its cancellation flag),
:class:`Outcome` and :class:`Done` (how a request ended: the last item of its stream),
:class:`PromptLogprobs` (a scored prompt, before its tokens),
:data:`Sink` (the engine's per-request callback), :class:`AsyncSink` (its asyncio end),
:class:`EngineSnapshot` (the counters /health, /metrics and /admin/state read),
:class:`OOVEvent`, :class:`LiveRequest` (the engine's record of a request it generates), the
submission errors :class:`EngineBusy` and :class:`EngineStopped`, and
:func:`deliver` / :func:`run_control` (an item to a sink, a control call into its future).
Knows token ids and decoding events only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from evospec.decoding.events import StepEvent
from evospec.decoding.logprobs import TokenLogprob
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats


class Outcome(StrEnum):
    """How a request ended (also the ``outcome`` label of the request metrics)."""

    FINISHED = "finished"  # the decoder stopped by itself: EOS / stop id / length
    STOP_STRING = "stop_string"  # the handler found a stop string and cancelled
    DISCONNECTED = "disconnected"  # the client went away
    TIMEOUT = "timeout"  # the request's deadline passed
    FAILED = "failed"  # the decoder raised
    SHUTDOWN = "shutdown"  # the server stopped before the request finished


@dataclass
class GenerationRequest:
    """One typed unit of work for the engine thread."""

    prompt_ids: list[int]  # [P] prompt token ids, already validated against the context window
    params: SamplingParams
    timeout_s: float  # from submission to the last token, queue wait included
    adapter_key: str | None = None  # online adaptation scope (conversation / tenant); None: global
    prompt_logprobs: int | None = None  # score the prompt first, with this many alternatives (echo)
    generate: bool = True  # False: score the prompt only (``max_tokens`` 0 with echo)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    submitted_at: float = field(default_factory=time.monotonic)
    cancelled_by: Outcome | None = field(default=None, init=False)  # set once, from any thread

    @property
    def deadline(self) -> float:
        return self.submitted_at + self.timeout_s

    def cancel(self, reason: Outcome) -> None:
        """Ask the engine to stop this request between rounds (idempotent; first reason wins)."""
        if self.cancelled_by is None:
            self.cancelled_by = reason


@dataclass(frozen=True)
class Done:
    """The last item of every request's stream."""

    outcome: Outcome
    error: str | None  # FAILED: the exception type and message
    stats: RequestStats  # this request's events, folded
    prompt_tokens: int
    queue_s: float  # submission -> start of generation (or of the decision not to run)
    first_token_s: float | None  # submission -> first token delivered
    total_s: float  # submission -> done


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own logprobs (``GenerationRequest.prompt_logprobs``), before any token:
    entry i is prompt token i + 1's."""

    entries: list[TokenLogprob]


Item = StepEvent | PromptLogprobs | Done
Sink = Callable[[Item], None]  # called on the engine thread; must not block


@dataclass(frozen=True)
class OOVEvent:
    """One round whose bonus token was outside the active vocabulary."""

    request_id: str
    round: int  # the request's round (1 = the first after the prefill)
    token: int | None  # the bonus token id that was not active
    time: float  # Unix time


RECENT_OOV = 32  # OOV events kept for /admin/state


class EngineBusy(Exception):
    """The queue is full; try again after ``retry_after_s`` seconds."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"{depth} requests are already waiting")
        self.depth = depth
        self.retry_after_s = retry_after_s


class EngineStopped(Exception):
    """The engine thread is not running."""


@dataclass
class LiveRequest:
    """A request being generated (the engine thread's): where its items go and what it has
    produced so far."""

    request: GenerationRequest
    sink: Sink
    start: float  # monotonic: when the engine took it
    stats: RequestStats = field(default_factory=RequestStats)
    first: float | None = None  # submission -> first token
    emitted: list[int] = field(default_factory=list)
    running: bool = False  # counted in the engine's running requests until it finishes


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters at one instant (read by /health, /metrics and /admin/state)."""

    method: str
    alive: bool
    active: bool  # a request is being generated right now
    running: int  # requests being generated right now (batched ones included)
    max_batch: int  # the most requests generated together (1: one at a time)
    queue_depth: int
    max_queue: int
    submitted: int
    rejected: int  # refused with EngineBusy
    outcomes: dict[str, int]  # Outcome value -> requests that ended so
    prompt_tokens: int
    stats: RequestStats  # every event the engine served, folded (a copy)
    recent_oov: tuple[OOVEvent, ...]  # the last RECENT_OOV OOV events, oldest first
    idle_work: str | None = None  # what the engine does while no request waits (service/idle.py)


class AsyncSink:
    """The handler's end of one request: a thread-safe :data:`Sink` feeding an asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._items: asyncio.Queue[Item] = asyncio.Queue()

    def __call__(self, item: Item) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._items.put_nowait, item)

    async def get(self, timeout: float) -> Item:
        """Next item; raises TimeoutError after ``timeout`` seconds."""
        return await asyncio.wait_for(self._items.get(), max(timeout, 0.0))


def run_control(fn: Callable[[], Any], fut: Future) -> None:
    """Run a control call ``fn`` into ``fut`` (never where the future was cancelled first)."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn())
    except Exception as exc:  # handed to the caller through the future
        fut.set_exception(exc)


def deliver(sink: Sink, item: Item) -> bool:
    """Push to the handler; False when it can no longer receive (its event loop is gone)."""
    try:
        sink(item)
        return True
    except Exception:
        return False

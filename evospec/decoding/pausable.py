"""Work that gives way to served requests: generators that yield where they may pause.

Owns: the :data:`Steps` protocol, :func:`drive` (run steps to their end at once: the CLI's and
the bench's use), :func:`checkpoint` (a pause point holding nothing), :func:`decode` (one prompt
decoded, pausable between rounds), :func:`timed` / :func:`rate` (a decoder's tokens and seconds
over prompts, measured again from the start when a pause fell inside the run) and :func:`warm`
(an untimed run).

The protocol. A ``Steps`` generator does a bounded piece of work between two ``yield`` s. Its
driver sends back ``pause``: False -- go on; True -- the driver wants the cores now. On True the
generator gives up what it holds suspended (a decoder's ``generate`` is closed, never resumed
after other work ran on the model) and yields once more at that clean point; the driver does
its work there and then resumes it (the value of that send is ignored). A timing that a pause
interrupted is void and is measured again.

The engine thread drives such steps while no request waits (``service/engine.py: IdleJob``):
``--method auto`` measures its candidates beside serving instead of before it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Sequence
from typing import TypeVar

T = TypeVar("T")
# yields None where it may pause; is sent whether the driver pauses it there; returns T
Steps = Generator[None, bool, T]


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end without pausing; its return value."""
    try:
        next(steps)
        while True:
            steps.send(False)
    except StopIteration as stop:
        return stop.value


def checkpoint() -> Steps[bool]:
    """A pause point where nothing is held: True when the driver paused there."""
    if (yield):
        yield  # the driver's work runs here
        return True
    return False


DONE, PAUSED, LATE = "done", "paused", "late"  # how a :func:`decode` ended


def decode(decoder, ids: Sequence[int], params, stop_at: float = math.inf) -> Steps[tuple[int, str]]:
    """Decode ``ids``, pausable after every round: (tokens written, :data:`DONE`, or
    :data:`PAUSED` / :data:`LATE` where a pause or ``stop_at`` -- a ``time.perf_counter()``
    instant -- cut it short). The decoder's generator is closed before this returns; after a
    pause the caller yields the clean point."""
    events = decoder.generate(ids, params)
    tokens = 0
    try:
        for ev in events:
            tokens += len(ev.tokens)
            if (yield):
                return tokens, PAUSED
            if time.perf_counter() > stop_at:
                return tokens, LATE
    finally:
        events.close()
    return tokens, DONE


def timed(
    decoder, prompts: Sequence[Sequence[int]], params, deadline: float = math.inf
) -> Steps[tuple[int, float]]:
    """(tokens, seconds) of ``decoder`` over ``prompts``; a run still going after ``deadline``
    seconds stops there (what it wrote so far). A run a pause interrupted is void: it is timed
    again from its first prompt once resumed."""
    while True:
        tokens, t0, end = 0, time.perf_counter(), DONE
        for ids in prompts:
            n, end = yield from decode(decoder, ids, params, stop_at=t0 + deadline)
            tokens += n
            if end != DONE:
                break
        if end != PAUSED:
            return tokens, max(time.perf_counter() - t0, 1e-9)
        yield  # the clean point: the driver's work runs here, then the run starts over


def rate(decoder, prompts: Sequence[Sequence[int]], params, deadline: float = math.inf) -> Steps[float]:
    """Tokens per second of :func:`timed`."""
    tokens, seconds = yield from timed(decoder, prompts, params, deadline)
    return tokens / seconds


def warm(decoder, ids: Sequence[int], params) -> Steps[None]:
    """Decode ``ids`` once, untimed (allocation, kernel choice); a pause ends it early."""
    _, end = yield from decode(decoder, ids, params)
    if end == PAUSED:
        yield

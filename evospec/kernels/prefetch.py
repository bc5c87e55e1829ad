"""The prefetch hint of the CPU weight loops (``vnni.h: prefetch_weight``), and how to pick one.

Owns: :data:`HINTS` (the op library's numbering), :func:`set_hints` / :func:`hints` (process
wide: every int4 and int8 loop of the op library reads them), :func:`time_hints` (the median
cost of a call under each streamed hint, the hints alternated) and :func:`pick` (the fastest;
the incumbent kept when within a margin). Knows the op library only; ``models/prefetch.py``
decides when to measure, on what, and caches the choice.

Two kinds of weight are prefetched ahead of the tile loops: *streamed* ones, read once a
forward (the target model's, ~94 MB a SmolLM2 step, more than most L3 caches), and *kept* ones,
read again soon (a draft's weights, its reduced LM head). Which hint is best for the streamed
ones is a property of the machine, not of the code: non-temporal prefetches (``nta``) keep the
stream from evicting what the next step reads again (a few % on a Zen 4, wave 40), while on an
Intel Xeon VM whose loads wait long for memory they made a step 2.6x as long as prefetching
into L2 (``t1``), which lets more lines be in flight (docs/benchmarks.md, wave 45).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

# (torch is imported where the op is called: option parsing reads HINTS without it)
HINTS = ("t0", "t1", "t2", "nta", "none")  # the op's numbering: 0 .. 4
STREAMED_DEFAULT = "nta"  # what the library starts with (the hint before wave 45)
KEPT_DEFAULT = "t0"
# the streamed hints a machine is measured with (t2 behaves as t1 where measured: left out)
CANDIDATES = ("nta", "t0", "t1", "none")


def available() -> bool:
    """Whether the op library with the int8-activation loops is loaded (else hints do nothing)."""
    from evospec.kernels.int4_matmul import vnni_available

    return vnni_available()


def set_hints(streamed: str, kept: str = KEPT_DEFAULT) -> None:
    """Use ``streamed`` for the weights read once a forward and ``kept`` for those read again
    soon, in every op of the library from now on (a no-op without the library)."""
    for h in (streamed, kept):
        if h not in HINTS:
            raise ValueError(f"prefetch hint {h!r} is not one of {list(HINTS)}")
    if available():
        import torch

        torch.ops.evospec.set_prefetch(HINTS.index(kept), HINTS.index(streamed))


def hints() -> tuple[str, str]:
    """The hints in use: (streamed, kept); the library's defaults without it."""
    if not available():
        return STREAMED_DEFAULT, KEPT_DEFAULT
    import torch

    kept, streamed = torch.ops.evospec.prefetch_hints()
    return HINTS[streamed], HINTS[kept]


def time_hints(
    call: Callable[[], object],
    candidates: Sequence[str] = CANDIDATES,
    *,
    rounds: int = 3,
    calls: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median milliseconds of ``call`` under each streamed hint: ``rounds`` passes over the
    candidates (the order rotating, so a slow phase of the machine is shared out), each a warm-up
    call and ``calls`` timed ones; a pass's median per hint, then the median of those. Leaves
    the streamed hint at the last one timed: the caller sets its choice."""
    kept = hints()[1]
    per: dict[str, list[float]] = {h: [] for h in candidates}
    for r in range(rounds):
        order = list(candidates[r % len(candidates) :]) + list(candidates[: r % len(candidates)])
        for h in order:
            set_hints(h, kept)
            call()
            times = []
            for _ in range(calls):
                t = clock()
                call()
                times.append(clock() - t)
            per[h].append(statistics.median(times) * 1e3)
    return {h: statistics.median(v) for h, v in per.items()}


def pick(timings: dict[str, float], incumbent: str = STREAMED_DEFAULT, margin: float = 0.03) -> str:
    """The fastest hint of ``timings``, except that ``incumbent`` stays when it is within
    ``margin`` of it (a close call is noise; the incumbent's cache behaviour was measured
    end to end, wave 40)."""
    best = min(timings, key=timings.__getitem__)
    if incumbent in timings and timings[incumbent] <= timings[best] * (1 + margin):
        return incumbent
    return best

"""How the CPU weight loops prefetch (``vnni.h: prefetch_weight``), and how to pick a setting.

Owns: :data:`HINTS` (the op library's numbering), :class:`Setting` (the streamed weights' hint
and distance, named ``HINT[:KIB]``; :func:`mode_problem` checks a ``--prefetch`` value),
:func:`apply` / :func:`current` (process wide: every int4 and int8 loop of the op library reads
them; :func:`set_hints` / :func:`hints` for the hints alone), :func:`time_settings` (the median
cost of a call under each candidate setting, alternated) and :func:`pick` (the fastest; the
incumbent kept when within a margin). Knows the op library only; ``models/prefetch.py`` decides
when to measure, on what, and caches the choice.

Two kinds of weight are prefetched ahead of the tile loops: *streamed* ones, read once a
forward (the target model's, ~94 MB a SmolLM2 step, more than most L3 caches), and *kept* ones,
read again soon (a draft's weights, its reduced LM head). How the streamed ones are best
prefetched is a property of the machine, not of the code:

- the hint: non-temporal prefetches (``nta``) keep the stream from evicting what the next step
  reads again (a few % on a Zen 4, wave 40), while on an Intel Xeon VM whose loads wait long
  for memory they made a step 2.6x as long as prefetching into L2 (``t1``), which lets more
  lines be in flight (docs/benchmarks.md, wave 45);
- the distance, bytes ahead of the group a loop is at: 2.5 KB until wave 46; on that VM, whose
  L3 holds most of a step's weights but answers slowly, 10 KB made a step ~20% shorter.

The kept weights' hint and distance stay at their defaults (the distance measured no different
for a draft's step: wave 46). The attention prefetches its keys and values :data:`KV_AHEAD_DEFAULT`
keys ahead (:func:`set_kv_ahead`, for A/B runs; ~7% of a step at 1,000 cached slots, wave 46).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# (torch is imported where the op is called: option parsing reads HINTS without it)
HINTS = ("t0", "t1", "t2", "nta", "none")  # the op's numbering: 0 .. 4
STREAMED_DEFAULT = "nta"  # what the library starts with (the hint before wave 45)
KEPT_DEFAULT = "t0"
DISTANCE_DEFAULT = 2560  # bytes ahead (8 int4 groups: the distance before wave 46)
DISTANCES = (2560, 5120, 10240, 20480)  # the streamed distances a machine is measured with
MAX_DISTANCE = 65536  # what the op accepts: multiples of 64 bytes up to this


@dataclass(frozen=True)
class Setting:
    """How the streamed weights are prefetched: ``hint`` (one of :data:`HINTS`) ``distance``
    bytes ahead (a multiple of 64, up to :data:`MAX_DISTANCE`; without a prefetch, ``none``,
    it has no effect). Named ``HINT[:KIB]``: ``t1:10`` is t1 10,240 bytes ahead."""

    hint: str
    distance: int = DISTANCE_DEFAULT

    def __post_init__(self) -> None:
        if self.hint not in HINTS:
            raise ValueError(f"prefetch hint {self.hint!r} is not one of {list(HINTS)}")
        if not (64 <= self.distance <= MAX_DISTANCE and self.distance % 64 == 0):
            raise ValueError(
                f"prefetch distance {self.distance} bytes: use a multiple of 64 up to {MAX_DISTANCE}"
            )

    def __str__(self) -> str:
        return "none" if self.hint == "none" else f"{self.hint}:{self.distance / 1024:g}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``HINT[:KIB]`` -> a setting (KIB: kibibytes ahead, e.g. 10 or 2.5; default 2.5);
        ValueError naming the accepted forms (:data:`FORMS`)."""
        hint, sep, kib = text.partition(":")
        try:
            return cls(hint, round(float(kib) * 1024) if sep else DISTANCE_DEFAULT)
        except (ValueError, OverflowError):  # (round(inf))
            raise ValueError(f"prefetch {text!r}: use {FORMS}") from None


FORMS = (
    f"HINT[:KIB], HINT one of {list(HINTS)} and KIB the kibibytes ahead "
    f"(a multiple of 1/16 up to {MAX_DISTANCE // 1024}; default {DISTANCE_DEFAULT / 1024:g})"
)


def mode_problem(mode: str) -> str | None:
    """What is wrong with a ``--prefetch`` value (``auto``, or a setting's name); None if nothing."""
    if mode == "auto":
        return None
    try:
        Setting.parse(mode)
    except ValueError:
        return f"prefetch {mode!r}: use auto or {FORMS}"
    return None


DEFAULT = Setting(STREAMED_DEFAULT)  # what the library starts with
# the settings a machine is measured with (t2 behaves as t1 where measured: left out)
CANDIDATES = (*(Setting(h, d) for h in ("nta", "t0", "t1") for d in DISTANCES), Setting("none"))


def available() -> bool:
    """Whether the op library with the int8-activation loops is loaded (else settings do nothing)."""
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


def apply(setting: Setting) -> None:
    """Prefetch the streamed weights as ``setting`` says from now on; the kept ones' hint and
    distance are left as they are (a no-op without the library)."""
    set_hints(setting.hint, hints()[1])
    if available():
        import torch

        kept = torch.ops.evospec.prefetch_distances()[0]
        torch.ops.evospec.set_prefetch_distance(kept, setting.distance)


def current() -> Setting:
    """The streamed weights' setting in use (the library's default without it)."""
    if not available():
        return DEFAULT
    import torch

    return Setting(hints()[0], torch.ops.evospec.prefetch_distances()[1])


KV_AHEAD_DEFAULT = 64  # keys ahead the attention prefetches its keys and values (attention.h)


def set_kv_ahead(keys: int) -> None:
    """Prefetch the attention's keys and values ``keys`` ahead from now on (0: not at all), in
    every attention of the op library; a no-op without it. For A/B runs: the default is the
    measured one (docs/benchmarks.md, wave 46)."""
    if not 0 <= keys <= 4096:
        raise ValueError(f"kv prefetch distance {keys} keys: use 0..4096")
    if available():
        import torch

        torch.ops.evospec.set_kv_ahead(keys)


def kv_ahead() -> int:
    """How many keys ahead the attention prefetches (the default without the op library)."""
    if not available():
        return KV_AHEAD_DEFAULT
    import torch

    return int(torch.ops.evospec.kv_ahead())


def time_settings(
    call: Callable[[], object],
    candidates: Sequence[Setting] = CANDIDATES,
    *,
    rounds: int = 3,
    calls: int = 8,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[Setting, float]:
    """Median milliseconds of ``call`` under each candidate setting: ``rounds`` passes over the
    candidates (the order rotating, so a slow phase of the machine is shared out), each a warm-up
    call and ``calls`` timed ones; a pass's median per setting, then the median of those. Leaves
    the last one timed in use: the caller applies its choice."""
    per: dict[Setting, list[float]] = {s: [] for s in candidates}
    for r in range(rounds):
        order = list(candidates[r % len(candidates) :]) + list(candidates[: r % len(candidates)])
        for s in order:
            apply(s)
            call()
            times = []
            for _ in range(calls):
                t = clock()
                call()
                times.append(clock() - t)
            per[s].append(statistics.median(times) * 1e3)
    return {s: statistics.median(v) for s, v in per.items()}


def pick(timings: dict[Setting, float], incumbent: Setting = DEFAULT, margin: float = 0.03) -> Setting:
    """The fastest setting of ``timings``, except that ``incumbent`` stays when it is within
    ``margin`` of it (a close call is noise; the incumbent's cache behaviour was measured end to
    end, wave 40)."""
    best = min(timings, key=timings.__getitem__)
    if incumbent in timings and timings[incumbent] <= timings[best] * (1 + margin):
        return incumbent
    return best

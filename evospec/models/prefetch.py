"""The streamed-weight prefetch hint for a loaded model on this machine: measured once, cached, set.

Owns: :class:`PrefetchChoice` and :func:`choose_prefetch` -- ``auto`` times the model's recorded
one-token step under each candidate hint (``kernels/prefetch.py``: alternated, medians), keeps
the fastest and caches it in ``$EVOSPEC_HOME/tuning/prefetch.json`` under a key naming the model,
its weight format, the machine, torch and the op library's build; a hint's name sets that hint
without measuring. The hint is process-wide (the op library has one), so a process serving one
model sets it once, before anything is timed: ``--tree auto``'s tuning keys on it.

Only CPU models whose quantised weights run the op library's loops (int4/int8 with the
int8-activation kernels) have a hint to choose; for the others the choice is ``None``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from evospec.common import evospec_home, machine_key, replace_json
from evospec.kernels import prefetch

CACHE_VERSION = "prefetch-v1"
STEP_SLOTS = 64  # the cache length the step is timed at (a short chat's; the hint's effect is the weights')


@dataclass(frozen=True)
class PrefetchChoice:
    """The streamed hint in use, and the medians (ms a step) it was chosen by (empty when named)."""

    hint: str
    timings: dict[str, float] = field(default_factory=dict)
    cached: bool = False

    def describe(self) -> str:
        """One line for the start-up facts."""
        if not self.timings:
            return f"weight prefetch: {self.hint} (as given)"
        others = ", ".join(f"{h} {ms:.2f}" for h, ms in sorted(self.timings.items()) if h != self.hint)
        src = "cached for this machine" if self.cached else "measured now, cached"
        return f"weight prefetch: {self.hint} ({self.timings[self.hint]:.2f} ms a step; {others}; {src})"


def applies(loaded) -> bool:
    """Whether ``loaded``'s weights run the op library's prefetching loops."""
    from evospec.models.quant import quant_kernel

    return (
        loaded.weights in ("int4", "int8")
        and next(loaded.model.parameters()).device.type == "cpu"
        and quant_kernel(16) == "vnni"
    )


def _key(loaded) -> str:
    from evospec.kernels.cpu_ops import build_key

    parts = [loaded.name, loaded.weights, machine_key(), torch.__version__, build_key(), CACHE_VERSION]
    return "|".join(parts)


def _cache_file():
    return evospec_home() / "tuning" / "prefetch.json"


def _read_cache(path) -> dict:
    """The cache's entries; none where the file is missing or unreadable (measured again, rewritten)."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def measure(loaded, **kwargs) -> dict[str, float]:
    """Median ms of ``loaded``'s one-token step (its recorded graph where it has one) under each
    candidate hint, at :data:`STEP_SLOTS` cached slots (``kwargs``: ``time_hints``'s)."""
    model = loaded.model
    cache = model.new_cache(STEP_SLOTS + 2)
    cache.length = STEP_SLOTS  # a step's cost does not depend on what the slots hold
    tokens, positions = torch.zeros(1, 1, dtype=torch.long), torch.tensor([STEP_SLOTS])
    graph = getattr(model, "step_graph", None)
    with torch.inference_mode():
        if graph is not None:
            graph.record(1, "last")

            def step() -> object:
                return graph(tokens, positions, cache, "last")
        else:

            def step() -> object:
                return model(tokens, positions, cache, logits="last")

        return prefetch.time_hints(step, **kwargs)


def choose_prefetch(loaded, mode: str = "auto") -> PrefetchChoice | None:
    """Set the streamed hint for ``loaded``: ``mode`` a hint's name, or ``auto`` (the cached
    choice, else measured now and cached). None where the model has no hint to choose."""
    if mode != "auto" and mode not in prefetch.HINTS:
        raise ValueError(f"--prefetch {mode!r}: use auto or one of {list(prefetch.HINTS)}")
    if not applies(loaded):
        return None
    kept = prefetch.hints()[1]
    if mode != "auto":
        prefetch.set_hints(mode, kept)
        return PrefetchChoice(mode)
    path, key = _cache_file(), _key(loaded)
    cache = _read_cache(path)
    cached = key in cache
    if not cached:
        timings = measure(loaded)
        cache = _read_cache(path)  # another process may have written meanwhile
        cache[key] = {"hint": prefetch.pick(timings), "ms": timings}
        replace_json(path, cache)
    entry = cache[key]
    prefetch.set_hints(entry["hint"], kept)
    return PrefetchChoice(entry["hint"], dict(entry["ms"]), cached)

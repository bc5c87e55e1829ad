"""How a loaded model's streamed weights are prefetched on this machine: measured once, cached, set.

Owns: :class:`PrefetchChoice`, :func:`choose_prefetch` and :func:`parse_mode` -- ``auto`` times
the model's recorded one-token step under each candidate setting (``kernels/prefetch.py``: hint x
distance, alternated, medians; ~3 s), keeps the fastest and caches it in
``$EVOSPEC_HOME/tuning/prefetch.json`` under a key naming the model, its weight format, the
machine, torch and the op library's build; a setting's name (``t1``, ``t1:10``) sets it without
measuring. The setting is process-wide (the op library has one), so a process serving one model
sets it once, before anything is timed: ``--tree auto``'s tuning keys on it.

Only CPU models whose quantised weights run the op library's loops (int4/int8 with the
int8-activation kernels) have a hint to choose; for the others the choice is ``None``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from evospec.common import evospec_home, machine_key, replace_json
from evospec.kernels import prefetch

CACHE_VERSION = "prefetch-v2"  # v2: a distance beside the hint (wave 46)
# The cache lengths a step is timed at: a short chat's, and a longer one's, where the attention's
# reads of keys and values run between the weights' (on one Xeon VM t0 and t1 prefetches 10 KiB
# ahead timed alike at 64 slots, and t1 ~6% faster at 512-1,000 and in decoding: wave 46).
STEP_SLOTS = (64, 512)


@dataclass(frozen=True)
class PrefetchChoice:
    """The streamed weights' setting in use, and the medians (ms a step, by setting name) it was
    chosen by (empty when named)."""

    setting: prefetch.Setting
    timings: dict[str, float] = field(default_factory=dict)
    cached: bool = False

    def describe(self) -> str:
        """One line for the start-up facts: the choice, and the library's default beside it."""
        name = str(self.setting)
        if not self.timings:
            return f"weight prefetch: {name} (as given)"
        src = "cached for this machine" if self.cached else "measured now, cached"
        default = str(prefetch.DEFAULT)
        against = f"; default {default} {self.timings[default]:.2f}" if default in self.timings else ""
        return (
            f"weight prefetch: {name} ({self.timings[name]:.2f} ms a step of {len(self.timings)} "
            f"settings timed{against}; {src})"
        )


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


def measure(loaded, **kwargs) -> dict[prefetch.Setting, float]:
    """Median ms of ``loaded``'s one-token step (its recorded graph where it has one) under each
    candidate setting, the mean of a step at each of :data:`STEP_SLOTS` cached slots
    (``kwargs``: ``time_settings``'s)."""
    model = loaded.model
    cache = model.new_cache(max(STEP_SLOTS) + 2)
    tokens = torch.zeros(1, 1, dtype=torch.long)
    graph = getattr(model, "step_graph", None)
    with torch.inference_mode():
        if graph is not None:
            graph.record(1, "last")

        def steps() -> None:
            for slots in STEP_SLOTS:
                cache.length = slots  # a step's cost does not depend on what the slots hold
                position = torch.tensor([slots])
                if graph is not None:
                    graph(tokens, position, cache, "last")
                else:
                    model(tokens, position, cache, logits="last")

        timings = prefetch.time_settings(steps, **kwargs)
    return {s: ms / len(STEP_SLOTS) for s, ms in timings.items()}


def choose_prefetch(loaded, mode: str = "auto") -> PrefetchChoice | None:
    """Apply the streamed weights' setting for ``loaded``: ``mode`` a setting's name
    (``HINT[:KIB]``), or ``auto`` (the cached choice, else measured now and cached). None where
    the model has no setting to choose."""
    named = parse_mode(mode)
    if not applies(loaded):
        return None
    if named is not None:
        prefetch.apply(named)
        return PrefetchChoice(named)
    path, key = _cache_file(), _key(loaded)
    entry = _entry(_read_cache(path).get(key))
    cached = entry is not None
    if entry is None:
        timings = measure(loaded)
        entry = prefetch.pick(timings), {str(s): v for s, v in timings.items()}
        cache = _read_cache(path)  # another process may have written meanwhile
        cache[key] = {"setting": str(entry[0]), "ms": entry[1]}
        replace_json(path, cache)
    prefetch.apply(entry[0])
    return PrefetchChoice(entry[0], entry[1], cached)


def _entry(raw) -> tuple[prefetch.Setting, dict[str, float]] | None:
    """A cache entry's setting and timings; None where it is missing or malformed (measured again)."""
    try:
        return prefetch.Setting.parse(raw["setting"]), {str(k): float(v) for k, v in raw["ms"].items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def parse_mode(mode: str) -> prefetch.Setting | None:
    """``--prefetch``'s value: None for ``auto``, else the named setting (ValueError naming the
    accepted forms)."""
    problem = prefetch.mode_problem(mode)
    if problem:
        raise ValueError(f"--{problem}")
    return None if mode == "auto" else prefetch.Setting.parse(mode)

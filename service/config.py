"""Serve options: one typed, validated dataclass, loaded from a ``configs/*.yaml`` preset.

Owns: :class:`ServeConfig` (what ``evospec serve`` runs: model, method, draft head, listen
address, queue and timeout limits, the adapter folder and restart snapshots; its ``tree``,
``vocab`` and ``adapt`` sections *are* the engine's ``TreeConfig``, ``VocabConfig`` and
``AdaptConfig``, read and checked by ``evospec/settings.py``, so the YAML keys, the
command-line flags of every command and the engine share one schema), :func:`load_config`
(YAML via ``yaml.safe_load``; unknown keys, wrong types and bad values are refused with a
message naming the file and the key) and :meth:`ServeConfig.with_overrides` (command-line
flags win over the file). Secrets never live here: the admin token is read from the
environment by ``app.py``. Knows nothing about models, HTTP or threads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import DRAFT_WEIGHTS, METHOD_SPECS, METHODS, VERIFY_LOGITS
from evospec.decoding.tree import TreeConfig
from evospec.decoding.tree_config import names_a_shape
from evospec.kernels.prefetch import mode_problem as prefetch_problem
from evospec.models.batch_step import AUTO_BATCH
from evospec.models.registry import DEFAULT_MODEL
from evospec.options import WEIGHT_CHOICES
from evospec.settings import SettingsError, check_type, section_from_mapping
from evospec.vocab.factory import VocabConfig

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A serve config (file or flags) is invalid; the message says where and why."""


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``evospec serve`` needs besides the admin token (an env variable)."""

    model: str = DEFAULT_MODEL  # registered name, Hugging Face folder or .gguf file
    method: str = "ar"  # decoding method: one of evospec.decoding.methods.METHODS, or "auto"
    draft: str | None = None  # EAGLE-2 head folder (default: the head shipped for the model)
    draft3: str | None = None  # EAGLE-3 head folder for eagle3 / *-e3 (default: the one shipped, if any)
    ngrams: str | None = None  # n-gram table for tree.table_lookup ("none": none; default: built/shipped)
    tree: TreeConfig = field(default_factory=TreeConfig)  # ignored by ar
    # true: the fastest tree shape measured on this machine (--tree auto); false: ``tree`` as
    # given; None (default): measured unless the config or the command line gives a shape
    tune_tree: bool | None = None
    vocab: VocabConfig = field(default_factory=VocabConfig)  # read by the vocabulary methods only
    adapt: AdaptConfig = field(default_factory=AdaptConfig)  # clora, osd, evospec-full; mode: the method's
    device: str = "cpu"  # torch device: "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16
    weights: str = "auto"  # linear weight format: auto (int4 on a CPU) | int4 | int8 | bf16 | fp32
    pack_weights: bool = True  # CPU fp32: reorder linear weights once for oneDNN (faster, +1 weight copy)
    prefix_reuse: bool = True  # keep the slots a prompt shares with the last request (decoding/prefix.py)
    prefix_cache_mb: int | None = None  # MiB for earlier sequences' slots (0: the last only; None: 256)
    verify_logits: str = "auto"  # tree nodes projected onto the vocabulary: auto | all | lazy
    draft_weights: str = "auto"  # non-adapting draft linears: auto | fp32 | int8 | int4 (decoding/methods.py)
    prefetch: str = "auto"  # CPU kernels' prefetch of the target's weights: auto | HINT[:KIB] (t1, t1:10)
    host: str = "127.0.0.1"  # listen address (0.0.0.0 inside a container)
    port: int = 8000
    max_queue: int = 64  # requests waiting for the engine; one more gets 503 + Retry-After
    # requests generated together where the model can (engine.py); 1: one at a time; "auto": as
    # many as one pass of the int4 kernel over a weight takes (8 on AVX-512, 4 elsewhere)
    max_batch: int | str = "auto"
    prefill_chunk: int = 128  # prompt tokens a joining request prefills between two batched steps
    request_timeout: float = 300.0  # seconds from arrival to the last token (queue wait included)
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413 (checked before reading them)
    body_read_timeout: float = 30.0  # seconds a request body may take to arrive; then 408
    served_model_name: str | None = None  # the "model" clients send; default: the loaded model's name
    adapter_dir: str | None = None  # admin adapter files (names only); None: $EVOSPEC_HOME/adapters
    persist_state: bool = True  # keep the ARC buffer (with vocab.persist) and adapters across restarts
    state_dir: str | None = None  # restart snapshots; None: $EVOSPEC_HOME/state
    snapshot_minutes: float = 10.0  # minutes between restart snapshots (0: only at shutdown)

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid serve config: " + "; ".join(problems))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> ServeConfig:
        """Build from a parsed YAML/JSON mapping; every key must be a known field."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a mapping of serve options, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        values = dict(raw)
        if isinstance(values.get("tree"), dict) and names_a_shape(values["tree"]):
            values.setdefault("tune_tree", False)  # a shape given is served, unless tune_tree: true
        try:
            for name, section in _SECTIONS.items():
                if name in values:
                    values[name] = section_from_mapping(section, values[name], name)
            for f in fields(cls):
                if f.name in values and f.name not in _SECTIONS:
                    check_type(f.name, values[f.name], _FIELD_TYPES[f.name])
            return cls(**values)
        except (ConfigError, SettingsError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def stack_settings(self):
        """What ``assembly.assemble`` loads for this server (one decoder: ``method``)."""
        from evospec.assembly import StackSettings

        return StackSettings(
            model=self.model,
            methods=(self.method,),
            draft=self.draft,
            draft3=self.draft3,
            ngrams=self.ngrams,
            tree=self.tree,
            tune_tree=self.tunes_tree,
            vocab=self.vocab,
            adapt=self.adapt,
            verify_logits=self.verify_logits,
            draft_weights=self.draft_weights,
            prefetch=self.prefetch,
            device=self.device,
            dtype=self.dtype,
            weights=self.weights,
            pack_weights=self.pack_weights,
            prefix_reuse=self.prefix_reuse,
            prefix_cache_mb=self.prefix_cache_mb,
        )

    @property
    def tunes_tree(self) -> bool:
        """Whether the served method's tree shape is measured (``tune_tree``; unset: unless a
        shape is given: a tree whose shape differs from the defaults)."""
        if self.tune_tree is not None:
            return self.tune_tree
        default = TreeConfig()
        changed = [
            f.name for f in fields(TreeConfig) if getattr(self.tree, f.name) != getattr(default, f.name)
        ]
        return not names_a_shape(changed)

    def with_overrides(self, **overrides: Any) -> ServeConfig:
        """A copy with the given fields replaced; ``None`` values are ignored (flag not given).
        ``tree``, ``vocab``, ``adapt`` take a mapping of the section's keys to change."""
        given = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(given.get("tree"), dict) and names_a_shape(given["tree"]):
            given.setdefault("tune_tree", False)  # tree flags fix the shape, unless with --tree auto
        try:
            for name, value in given.items():
                if name in _SECTIONS:
                    given[name] = section_from_mapping(_SECTIONS[name], value, name, base=getattr(self, name))
                elif name not in _FIELD_TYPES:
                    raise ConfigError(f"unknown serve option {name!r}")
                else:
                    check_type(name, value, _FIELD_TYPES[name])
            return dataclasses.replace(self, **given)
        except (ConfigError, SettingsError) as exc:
            raise ConfigError(f"command line: {exc}") from None


_SECTIONS: dict[str, type] = {"tree": TreeConfig, "vocab": VocabConfig, "adapt": AdaptConfig}

# Accepted Python types per top-level field (YAML ints are accepted where floats are expected).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "method": (str,),
    "draft": (str, type(None)),
    "draft3": (str, type(None)),
    "ngrams": (str, type(None)),
    "device": (str,),
    "dtype": (str,),
    "weights": (str,),
    "pack_weights": (bool,),
    "prefix_reuse": (bool,),
    "prefix_cache_mb": (int, type(None)),
    "tune_tree": (bool, type(None)),
    "verify_logits": (str,),
    "draft_weights": (str,),
    "prefetch": (str,),
    "host": (str,),
    "port": (int,),
    "max_queue": (int,),
    "max_batch": (int, str),
    "prefill_chunk": (int,),
    "request_timeout": (int, float),
    "max_tokens_limit": (int,),
    "max_body_bytes": (int,),
    "body_read_timeout": (int, float),
    "served_model_name": (str, type(None)),
    "adapter_dir": (str, type(None)),
    "persist_state": (bool,),
    "state_dir": (str, type(None)),
    "snapshot_minutes": (int, float),
}


def _problems(c: ServeConfig) -> list[str]:
    out = []
    if c.method not in (*METHODS, "auto"):
        out.append(f"method {c.method!r} is not one of {[*METHODS, 'auto']}")
    if c.dtype not in DTYPES:
        out.append(f"dtype {c.dtype!r} is not one of {list(DTYPES)}")
    if c.weights not in WEIGHT_CHOICES:
        out.append(f"weights {c.weights!r} is not one of {list(WEIGHT_CHOICES)}")
    if not c.model:
        out.append("model must not be empty")
    if not 0 <= c.port <= 65535:
        out.append(f"port {c.port} is outside 0..65535")
    if c.max_queue < 1:
        out.append(f"max_queue must be >= 1, got {c.max_queue}")
    if c.max_batch != AUTO_BATCH and (isinstance(c.max_batch, str) or c.max_batch < 1):
        one = "1: one request at a time"
        out.append(f"max_batch must be >= 1 ({one}) or {AUTO_BATCH!r}, got {c.max_batch!r}")
    if c.prefill_chunk < 1:
        out.append(f"prefill_chunk must be >= 1, got {c.prefill_chunk}")
    if not c.request_timeout > 0:
        out.append(f"request_timeout must be > 0 seconds, got {c.request_timeout}")
    if c.max_tokens_limit < 1:
        out.append(f"max_tokens_limit must be >= 1, got {c.max_tokens_limit}")
    if c.max_body_bytes < 1:
        out.append(f"max_body_bytes must be >= 1, got {c.max_body_bytes}")
    if not c.body_read_timeout > 0:
        out.append(f"body_read_timeout must be > 0 seconds, got {c.body_read_timeout}")
    if c.prefix_cache_mb is not None and c.prefix_cache_mb < 0:
        out.append(
            f"prefix_cache_mb must be >= 0 (0: keep the last request's slots only), got {c.prefix_cache_mb}"
        )
    if not (0 <= c.snapshot_minutes < float("inf")):
        out.append(f"snapshot_minutes must be >= 0 (0: only at shutdown), got {c.snapshot_minutes}")
    for name in ("adapter_dir", "state_dir"):
        if getattr(c, name) == "":
            out.append(f"{name} must not be empty (null: the default folder)")
    if c.verify_logits not in VERIFY_LOGITS:
        out.append(f"verify_logits {c.verify_logits!r} is not one of {list(VERIFY_LOGITS)}")
    if c.draft_weights not in DRAFT_WEIGHTS:
        out.append(f"draft_weights {c.draft_weights!r} is not one of {list(DRAFT_WEIGHTS)}")
    if prefetch_problem(c.prefetch):
        out.append(prefetch_problem(c.prefetch))
    spec = METHOD_SPECS.get(c.method)
    problem = c.vocab.budget_problem(spec.policy) if spec is not None and spec.policy else None
    return out + ([problem] if problem else [])


def load_config(path: str | Path) -> ServeConfig:
    """Read a YAML preset (e.g. ``configs/eagle2.yaml``) into a validated :class:`ServeConfig`."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return ServeConfig.from_dict(raw if raw is not None else {}, source=str(path))

"""Serve options: one typed, validated dataclass, loaded from a ``configs/*.yaml`` preset.

Owns: :class:`ServeConfig` (what ``evospec serve`` runs: model, method, draft head, tree shape,
listen address, queue and timeout limits), :func:`load_config` (YAML via ``yaml.safe_load``;
unknown keys, wrong types and bad values are refused with a message naming the file and the
key) and :meth:`ServeConfig.with_overrides` (command-line flags win over the file). Secrets never
live here: the admin token is read from the environment by ``app.py``.
Knows nothing about models, HTTP or threads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from evospec.decoding.methods import METHODS
from evospec.models.registry import DEFAULT_MODEL

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A serve config (file or flags) is invalid; the message says where and why."""


@dataclass(frozen=True)
class TreeSettings:
    """EAGLE-2 draft tree shape (see ``evospec/decoding/tree.py``); ignored by ``ar``."""

    top_k: int = 10  # children per expanded node and frontier width
    depth: int = 5  # draft levels per round
    total_tokens: int = 60  # draft tokens verified per round


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``evospec serve`` needs besides the admin token (an env variable)."""

    model: str = DEFAULT_MODEL  # registered name, Hugging Face folder or .gguf file
    method: str = "ar"  # decoding method: one of evospec.decoding.methods.METHODS
    draft: str | None = None  # EAGLE-2 head folder (default: the head shipped for the model)
    tree: TreeSettings = field(default_factory=TreeSettings)
    device: str = "cpu"  # torch device: "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16
    host: str = "127.0.0.1"  # listen address (0.0.0.0 inside a container)
    port: int = 8000
    max_queue: int = 64  # requests waiting for the engine; one more gets 503 + Retry-After
    request_timeout: float = 300.0  # seconds from arrival to the last token (queue wait included)
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    served_model_name: str | None = None  # the "model" clients send; default: the loaded model's name

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
        if "tree" in values:
            values["tree"] = _tree_from(values["tree"], source)
        for f in fields(cls):
            if f.name in values and f.name != "tree":
                _check_type(f.name, values[f.name], _FIELD_TYPES[f.name], source)
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def with_overrides(self, **overrides: Any) -> ServeConfig:
        """A copy with the given fields replaced; ``None`` values are ignored (flag not given)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        for name, value in given.items():
            if name == "tree":
                continue
            if name not in _FIELD_TYPES:
                raise ConfigError(f"unknown serve option {name!r}")
            _check_type(name, value, _FIELD_TYPES[name], "command line")
        return dataclasses.replace(self, **given)


# Accepted Python types per field (YAML ints are accepted where floats are expected).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "method": (str,),
    "draft": (str, type(None)),
    "device": (str,),
    "dtype": (str,),
    "host": (str,),
    "port": (int,),
    "max_queue": (int,),
    "request_timeout": (int, float),
    "max_tokens_limit": (int,),
    "served_model_name": (str, type(None)),
}


def _check_type(name: str, value: Any, types: tuple[type, ...], source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, types):
        want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{source}: {name} must be {want}, got {value!r}")


def _tree_from(raw: Any, source: str) -> TreeSettings:
    if isinstance(raw, TreeSettings):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: tree must be a mapping with top_k, depth, total_tokens")
    known = {f.name for f in fields(TreeSettings)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown tree key(s) {unknown}; known: {sorted(known)}")
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{source}: tree.{k} must be an integer >= 1, got {v!r}")
    return TreeSettings(**raw)


def _problems(c: ServeConfig) -> list[str]:
    out = []
    if c.method not in METHODS:
        out.append(f"method {c.method!r} is not one of {list(METHODS)}")
    if c.dtype not in DTYPES:
        out.append(f"dtype {c.dtype!r} is not one of {list(DTYPES)}")
    if not c.model:
        out.append("model must not be empty")
    if not 0 <= c.port <= 65535:
        out.append(f"port {c.port} is outside 0..65535")
    if c.max_queue < 1:
        out.append(f"max_queue must be >= 1, got {c.max_queue}")
    if not c.request_timeout > 0:
        out.append(f"request_timeout must be > 0 seconds, got {c.request_timeout}")
    if c.max_tokens_limit < 1:
        out.append(f"max_tokens_limit must be >= 1, got {c.max_tokens_limit}")
    t = c.tree
    if min(t.top_k, t.depth, t.total_tokens) < 1:
        out.append(f"tree values must be >= 1, got {t}")
    return out


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

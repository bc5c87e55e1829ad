"""Serve options: one typed, validated dataclass, loaded from a ``configs/*.yaml`` preset.

Owns: :class:`ServeConfig` (what ``evospec serve`` runs: model, method, draft head, tree shape,
active-vocabulary and online-adaptation settings, listen address, queue and timeout limits),
:func:`load_config` (YAML via ``yaml.safe_load``; unknown keys, wrong types and bad values are refused with a
message naming the file and the key) and :meth:`ServeConfig.with_overrides` (command-line flags
win over the file). Secrets never live here: the admin token is read from the environment by
``app.py``. Knows nothing about models, HTTP or threads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import METHOD_SPECS, METHODS, VERIFY_LOGITS
from evospec.models.registry import DEFAULT_MODEL
from evospec.vocab.factory import VocabConfig

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A serve config (file or flags) is invalid; the message says where and why."""


@dataclass(frozen=True)
class TreeSettings:
    """EAGLE-2 draft tree shape (see ``evospec/decoding/tree.py``); ignored by ``ar``."""

    top_k: int = 10  # children per expanded node and frontier width
    depth: int = 5  # draft levels per round
    total_tokens: int = 60  # draft tokens verified per round


_D = VocabConfig  # the engine's defaults (the papers' settings) are the only copy of them


@dataclass(frozen=True)
class VocabSettings:
    """Active-vocabulary hyper-parameters (``evospec/vocab/factory.py: VocabConfig``) and the
    index folder; read by ``frspec``, ``nanospec``, ``evospec``, ``nanospec+evospec`` only."""

    frspec_k: int | None = _D.frspec_k  # static table size (frspec; evospec's core); null: V/4 or 32768
    core_k: int | None = _D.core_k  # evospec's core alone; null: frspec_k
    k_pre: int = _D.k_pre  # NanoSpec: top target ids per prompt position at prefill
    k_ver: int = _D.k_ver  # NanoSpec: top target ids per verified-path node per round
    w_max: int = _D.w_max  # NanoSpec window; the nanospec+evospec budget (window + ARC)
    arc_capacity: int = _D.arc_capacity  # EvoSpec dynamic buffer: resident ids |T1| + |T2|
    arc_ghost: int = _D.arc_ghost  # each ghost list: |B1|, |B2| <= this
    arc_p_init: int = _D.arc_p_init  # ARC's initial target size of T1 (clamped to arc_capacity)
    arc_max_insert: int = _D.arc_max_insert  # ids inserted per OOV event at most
    arc_min_residency: int = _D.arc_min_residency  # rounds an id stays before it may be evicted
    arc_warmup: int = _D.arc_warmup  # OOV events during which p stays at arc_p_init
    n_top: int = _D.n_top  # retrieval seeds: the target's top ids at the OOV position
    n_sem: int = _D.n_sem  # retrieval seeds: HNSW neighbours of the target hidden state (0: off)
    per_seed: int = _D.per_seed  # bigram-graph successors added per seed (0: off)
    max_pending: int = _D.max_pending  # retrievals in flight before new OOV events are dropped
    persist: bool = _D.persist  # keep the ARC buffer across requests (false: empty it per request)
    indices: str | None = None  # index folder; null: $EVOSPEC_HOME/indices/<model>, built on first use

    def to_vocab_config(self) -> VocabConfig:
        """The engine's config (asynchronous retrieval, as served)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "indices"}
        return VocabConfig(**kw)


_A = AdaptConfig
SCOPES = ("global", "user")


@dataclass(frozen=True)
class AdaptSettings:
    """Online adaptation (``evospec/adapt/config.py: AdaptConfig``; the mode follows the method);
    read by ``clora``, ``osd`` and ``evospec-full`` only."""

    buffer_size: int = _A.buffer_size  # admitted positions per update (B)
    lr: float = _A.lr  # AdamW learning rate
    weight_decay: float = _A.weight_decay
    temperature: float = _A.temperature  # distillation temperature T_KD
    k_logit: int = _A.k_logit  # retained target logits per position
    gate_kl: float = _A.gate_kl  # admission: KL(target || draft) above this, or a rejected draft
    rank: int = _A.rank  # LoRA rank (clora, evospec-full)
    alpha: float = _A.alpha  # LoRA alpha
    beta: float = _A.beta  # curriculum decay
    context: int = _A.context  # committed pairs replayed before each round's root
    steps_per_update: int = _A.steps_per_update
    grad_clip: float = _A.grad_clip  # max grad norm (<= 0: off)
    max_loss: float = _A.max_loss  # a loss above this discards the update
    max_pending: int = _A.max_pending  # rounds queued for the worker before new ones are dropped
    max_keys: int = _A.max_keys  # adapter states kept (LRU) when scope is "user"
    nice: int = _A.nice  # CPU: niceness added to the update thread
    seed: int = _A.seed  # LoRA initialisation seed of every new adapter
    scope: str = "global"  # "global": one adapter; "user": one per request's OpenAI ``user`` field

    def to_adapt_config(self, mode: str) -> AdaptConfig:
        kw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scope"}
        return AdaptConfig(mode=mode, **kw)


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``evospec serve`` needs besides the admin token (an env variable)."""

    model: str = DEFAULT_MODEL  # registered name, Hugging Face folder or .gguf file
    method: str = "ar"  # decoding method: one of evospec.decoding.methods.METHODS, or "auto"
    draft: str | None = None  # EAGLE-2 head folder (default: the head shipped for the model)
    tree: TreeSettings = field(default_factory=TreeSettings)
    vocab: VocabSettings = field(default_factory=VocabSettings)
    adapt: AdaptSettings = field(default_factory=AdaptSettings)
    device: str = "cpu"  # torch device: "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    dtype: str = "float32"  # weights dtype: float32 | bfloat16 | float16
    pack_weights: bool = True  # CPU fp32: reorder linear weights once for oneDNN (faster, +1 weight copy)
    verify_logits: str = "auto"  # tree nodes projected onto the vocabulary: auto | all | lazy
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
        if "vocab" in values:
            values["vocab"] = _vocab_from(values["vocab"], source)
        if "adapt" in values:
            values["adapt"] = _adapt_from(values["adapt"], source)
        for f in fields(cls):
            if f.name in values and f.name not in _SECTIONS:
                _check_type(f.name, values[f.name], _FIELD_TYPES[f.name], source)
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def stack_settings(self):
        """What ``assembly.assemble`` loads for this server (one decoder: ``method``)."""
        from evospec.assembly import StackSettings
        from evospec.decoding.tree import TreeConfig

        t = self.tree
        return StackSettings(
            model=self.model,
            methods=(self.method,),
            draft=self.draft,
            tree=TreeConfig(top_k=t.top_k, depth=t.depth, total_tokens=t.total_tokens),
            vocab=self.vocab.to_vocab_config(),
            indices=self.vocab.indices,
            adapt=self.adapt.to_adapt_config(METHOD_SPECS[self.method].adapt or "clora")
            if self.method in METHOD_SPECS
            else self.adapt.to_adapt_config("clora"),
            verify_logits=self.verify_logits,
            device=self.device,
            dtype=self.dtype,
            pack_weights=self.pack_weights,
        )

    def with_overrides(self, **overrides: Any) -> ServeConfig:
        """A copy with the given fields replaced; ``None`` values are ignored (flag not given)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        for name, value in given.items():
            if name in _SECTIONS:
                continue
            if name not in _FIELD_TYPES:
                raise ConfigError(f"unknown serve option {name!r}")
            _check_type(name, value, _FIELD_TYPES[name], "command line")
        return dataclasses.replace(self, **given)


_SECTIONS = ("tree", "vocab", "adapt")  # nested mappings, checked key by key

# Accepted Python types per field (YAML ints are accepted where floats are expected).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "method": (str,),
    "draft": (str, type(None)),
    "device": (str,),
    "dtype": (str,),
    "pack_weights": (bool,),
    "verify_logits": (str,),
    "host": (str,),
    "port": (int,),
    "max_queue": (int,),
    "request_timeout": (int, float),
    "max_tokens_limit": (int,),
    "served_model_name": (str, type(None)),
}


def _check_type(name: str, value: Any, types: tuple[type, ...], source: str) -> None:
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{source}: {name} must be {want}, got {value!r}")


def _section(raw: Any, cls: type, name: str, what: str, source: str) -> dict[str, Any]:
    """A nested config mapping whose keys are ``cls``'s fields (else a ConfigError naming them)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {name} must be a mapping {what}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown {name} key(s) {unknown}; known: {sorted(known)}")
    return raw


def _tree_from(raw: Any, source: str) -> TreeSettings:
    if isinstance(raw, TreeSettings):
        return raw
    raw = _section(raw, TreeSettings, "tree", "with top_k, depth, total_tokens", source)
    for k, v in raw.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{source}: tree.{k} must be an integer >= 1, got {v!r}")
    return TreeSettings(**raw)


_VOCAB_TYPES: dict[str, tuple[type, ...]] = {f.name: (int,) for f in fields(VocabSettings)} | {
    "frspec_k": (int, type(None)),
    "core_k": (int, type(None)),
    "persist": (bool,),
    "indices": (str, type(None)),
}
_AT_LEAST_1 = ("k_pre", "k_ver", "w_max", "arc_capacity", "n_top", "max_pending")
_AT_LEAST_0 = (
    "arc_ghost",
    "arc_p_init",  # above arc_capacity it is clamped to it, as ARC does
    "arc_max_insert",
    "arc_min_residency",
    "arc_warmup",
    "n_sem",
    "per_seed",
)


def _typed_section(raw: Any, cls: type, name: str, what: str, types: dict, source: str) -> Any:
    """``cls(**raw)`` after checking the keys (``_section``) and each value's type."""
    if isinstance(raw, cls):
        return raw
    raw = _section(raw, cls, name, what, source)
    for k, v in raw.items():
        _check_type(f"{name}.{k}", v, types[k], source)
    return cls(**raw)


def _vocab_from(raw: Any, source: str) -> VocabSettings:
    return _typed_section(raw, VocabSettings, "vocab", "of vocabulary settings", _VOCAB_TYPES, source)


_ADAPT_TYPES: dict[str, tuple[type, ...]] = {
    f.name: ((int, float) if f.type == "float" else (str,) if f.type == "str" else (int,))
    for f in fields(AdaptSettings)
}


def _adapt_from(raw: Any, source: str) -> AdaptSettings:
    return _typed_section(raw, AdaptSettings, "adapt", "of online-adaptation settings", _ADAPT_TYPES, source)


def _adapt_problems(a: AdaptSettings, method: str) -> list[str]:
    out = [] if a.scope in SCOPES else [f"adapt.scope {a.scope!r} is not one of {list(SCOPES)}"]
    try:
        spec = METHOD_SPECS.get(method)
        a.to_adapt_config(spec.adapt if spec is not None and spec.adapt else "clora")
    except ValueError as exc:
        out.append(str(exc).replace("adapt ", "adapt.", 1))
    return out


def _vocab_problems(v: VocabSettings, method: str) -> list[str]:
    out = [f"vocab.{k} must be >= 1, got {getattr(v, k)}" for k in _AT_LEAST_1 if getattr(v, k) < 1]
    out += [f"vocab.{k} must be >= 0, got {getattr(v, k)}" for k in _AT_LEAST_0 if getattr(v, k) < 0]
    for k in ("frspec_k", "core_k"):
        if getattr(v, k) is not None and getattr(v, k) < 1:
            out.append(f"vocab.{k} must be >= 1 or null, got {getattr(v, k)}")
    if v.indices == "":
        out.append("vocab.indices must not be empty (null: the default folder)")
    spec = METHOD_SPECS.get(method)
    if spec is not None and spec.policy is not None and not out:
        problem = v.to_vocab_config().budget_problem(spec.policy)
        if problem:
            out.append(problem)
    return out


def _problems(c: ServeConfig) -> list[str]:
    out = []
    if c.method not in (*METHODS, "auto"):
        out.append(f"method {c.method!r} is not one of {[*METHODS, 'auto']}")
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
    if c.verify_logits not in VERIFY_LOGITS:
        out.append(f"verify_logits {c.verify_logits!r} is not one of {list(VERIFY_LOGITS)}")
    t = c.tree
    if min(t.top_k, t.depth, t.total_tokens) < 1:
        out.append(f"tree values must be >= 1, got {t}")
    return out + _vocab_problems(c.vocab, c.method) + _adapt_problems(c.adapt, c.method)


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

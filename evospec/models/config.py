"""Model configuration: one typed dataclass for every supported target family.

Owns: the architecture hyper-parameters the compact transformer needs, and the translation
from / to a Hugging Face ``config.json`` dictionary. It does not know about weights, files
or tokenizers.

Families and what sets them apart:
- ``llama``  (SmolLM2, Llama-3.x): SiLU-gated MLP, RMSNorm, optional llama3 RoPE scaling.
- ``qwen2``  (Qwen2 / Qwen2.5): as llama, plus biases on q/k/v projections.
- ``qwen3``: as llama, plus per-head RMSNorm on queries and keys (``qk_norm``).
- ``gemma3`` (text): GeGLU (tanh) MLP, norms scale by ``1 + w``, embeddings scaled by
  sqrt(hidden), four norms per block, per-head q/k norms, interleaved sliding-window and
  global layers with separate RoPE bases, ``query_pre_attn_scalar`` attention scale.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")

# HF ``model_type`` / ``architectures`` -> our family name.
_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture this engine does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only target transformer (all sizes in elements)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    # llama3 / linear scaling as in HF configs, or {"rope_type": "freq_factors", "factors": [...]}
    # (per-frequency divisors, as llama.cpp stores llama3 scaling in GGUF files)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (qwen3, gemma3)
    hidden_act: str = "silu"  # "silu" | "gelu_pytorch_tanh"
    # Gemma3 specifics (ignored by other families).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"unknown family {self.family!r}; supported: {FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must have one entry per layer")

    # -- derived properties -------------------------------------------------------------------
    @property
    def is_gemma(self) -> bool:
        return self.family == "gemma3"

    @property
    def norm_offset(self) -> float:
        """Gemma norms multiply by (1 + w); the others by w."""
        return 1.0 if self.is_gemma else 0.0

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size) if self.is_gemma else 1.0

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    # -- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dictionary (text models only)."""
        if "text_config" in d and d.get("model_type") == "gemma3":
            d = {**d["text_config"], "model_type": "gemma3_text"}
        model_type = d.get("model_type")
        family = _MODEL_TYPES.get(model_type or "")
        if family is None:
            archs = d.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                f"supported model types: {sorted(_MODEL_TYPES)}"
            )
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        layer_types: tuple[str, ...] = ()
        sliding_window = None
        if family == "gemma3":
            sliding_window = d.get("sliding_window", 4096)
            if d.get("layer_types"):
                layer_types = tuple(d["layer_types"])
            else:
                pattern = d.get("sliding_window_pattern", 6)
                layer_types = tuple(
                    "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                    for i in range(d["num_hidden_layers"])
                )
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"unsupported activation {act!r}")
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rope_params = d.get("rope_parameters")  # transformers >= 5 layout
        local_theta = d.get("rope_local_base_freq", 10_000.0)
        if isinstance(rope_params, dict):
            params = rope_params.get("full_attention", rope_params)
            if rope_theta is None:
                rope_theta = params.get("rope_theta")
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = params
            local_theta = rope_params.get("sliding_attention", {}).get("rope_theta", local_theta)
        return cls(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10_000.0),
            rope_scaling=_normalise_rope_scaling(rope_scaling),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", family == "gemma3")),
            attention_bias=bool(d.get("attention_bias", family == "qwen2")),
            qk_norm=family in ("qwen3", "gemma3"),
            hidden_act=act,
            sliding_window=sliding_window,
            layer_types=layer_types,
            rope_local_base_freq=float(local_theta),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that both this engine and transformers can load."""
        d: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": _HF_MODEL_TYPE[self.family],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.family in ("llama", "qwen2"):
            d["attention_bias"] = self.attention_bias
        if self.is_gemma:
            d.update(
                hidden_activation=self.hidden_act,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
                rope_local_base_freq=self.rope_local_base_freq,
                query_pre_attn_scalar=self.query_pre_attn_scalar,
                final_logit_softcapping=self.final_logit_softcapping,
                attn_logit_softcapping=self.attn_logit_softcapping,
            )
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _normalise_rope_scaling(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in ("llama3", "linear", "freq_factors"):
        raise UnsupportedModelError(f"unsupported rope_scaling type {rope_type!r}")
    return {**rs, "rope_type": rope_type}

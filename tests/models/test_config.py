"""ModelConfig: translation from/to Hugging Face config dictionaries and validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evospec.models.config import ModelConfig, UnsupportedModelError
from tests.conftest import FAMILIES, GEMMA_WINDOW, tiny_hf_config, tiny_models


def _base(**kw) -> dict:
    d = dict(
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    d.update(kw)
    return d


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_dict_reads_every_family(family: str) -> None:
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family).to_dict())
    assert cfg.family == family
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (
        128,
        64,
        3,
        4,
        2,
    )
    assert cfg.head_dim == 16
    assert cfg.attention_bias == (family == "qwen2")
    assert cfg.qk_norm == (family in ("qwen3", "gemma3"))
    assert cfg.tie_word_embeddings == (family == "gemma3")
    if family == "gemma3":
        assert cfg.sliding_window == GEMMA_WINDOW
        assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
        assert cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.attn_scale == pytest.approx(16**-0.5)
        assert cfg.rope_theta == 1_000_000.0 and cfg.rope_local_base_freq == 10_000.0
        assert [cfg.is_sliding(i) for i in range(3)] == [True, True, False]
    if family == "llama":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
        assert cfg.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_dict_round_trips_through_transformers(family: str, tmp_path: Path) -> None:
    """Our config.json, loaded by transformers and read back, is the same config."""
    from transformers import AutoConfig

    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family).to_dict())
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg


def test_legacy_rope_scaling_and_theta_keys() -> None:
    cfg = ModelConfig.from_hf_dict(
        _base(rope_theta=500_000.0, rope_scaling={"type": "linear", "factor": 2.0})
    )
    assert cfg.rope_theta == 500_000.0
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert ModelConfig.from_hf_dict(_base(rope_scaling={"rope_type": "default"})).rope_scaling is None


def test_gemma3_multimodal_config_uses_text_config() -> None:
    text = tiny_hf_config("gemma3").to_dict()
    cfg = ModelConfig.from_hf_dict({"model_type": "gemma3", "text_config": text})
    assert cfg == ModelConfig.from_hf_dict(text)


def test_gemma3_default_layer_pattern() -> None:
    d = _base(
        model_type="gemma3_text", num_hidden_layers=12, head_dim=16, hidden_activation="gelu_pytorch_tanh"
    )
    cfg = ModelConfig.from_hf_dict(d)
    assert [i for i in range(12) if not cfg.is_sliding(i)] == [5, 11]


def test_eos_list_and_defaults() -> None:
    cfg = ModelConfig.from_hf_dict(_base(eos_token_id=[5, 7]))
    assert cfg.eos_token_ids == (5, 7)
    assert ModelConfig.from_hf_dict(_base(eos_token_id=3)).eos_token_ids == (3,)
    assert ModelConfig.from_hf_dict(_base()).eos_token_ids == ()
    assert ModelConfig.from_hf_dict(_base(num_key_value_heads=None)).num_kv_heads == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "gpt2"),
        ({"hidden_act": "relu"}, "relu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ],
)
def test_unsupported_configs_raise(overrides: dict, needle: str) -> None:
    with pytest.raises(UnsupportedModelError, match=needle):
        ModelConfig.from_hf_dict(_base(**overrides))


def test_post_init_validation() -> None:
    ok = ModelConfig.from_hf_dict(_base())
    kw = ok.to_dict()
    with pytest.raises(UnsupportedModelError):
        ModelConfig(**{**kw, "family": "gpt2"})
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(**{**kw, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**{**kw, "layer_types": ("full_attention",)})


def test_gemma3_local_rope_base_from_rope_parameters() -> None:
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
    }
    pair = tiny_models("gemma3", rope_parameters=rope)
    assert pair.cfg.rope_local_base_freq == 500.0

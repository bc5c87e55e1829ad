"""Shared fixtures: tiny random models (HF reference + ours with identical weights), the tiny
speculative-decoding target with its random draft head (per module), and the real default
model, loaded once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from evospec.models.config import ModelConfig
from evospec.models.eagle import EagleHead, new_eagle_for
from evospec.models.loading import LoadedModel
from evospec.models.transformer import Transformer
from tests.decoding.spec_helpers import tiny_target

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
TINY_VOCAB = 128
GEMMA_WINDOW = 8  # sliding window of the tiny gemma3 config


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests are skipped cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_hf_config(family: str, **overrides: Any):
    """A transformers config of ``family``: vocab 128, hidden 64, 3 layers, 4 heads, 2 kv heads."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg = LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    elif family == "qwen2":
        cfg = Qwen2Config(**common)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=16)
    elif family == "gemma3":
        common["tie_word_embeddings"] = True
        cfg = Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=GEMMA_WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) activations (so parity checks are meaningful); perturbed norms and biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:  # norm weights (w or 1 + w) and biases
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)


@dataclass
class TinyPair:
    hf: Any  # transformers PreTrainedModel (eval, fp32)
    ours: Transformer
    cfg: ModelConfig


def tiny_models(family: str, seed: int = 0, *, attn: str = "eager", **overrides: Any) -> TinyPair:
    """A random HF model of ``family`` and our :class:`Transformer` holding the same weights."""
    from transformers import AutoModelForCausalLM

    hf_cfg = tiny_hf_config(family, **overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=attn, dtype=torch.float32)
    _randomise(hf, seed)
    hf.eval()
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    ours = Transformer(cfg)
    state = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or cfg.tie_word_embeddings), missing
    ours.eval()
    return TinyPair(hf, ours, cfg)


def hf_logits(hf: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Full-sequence logits of a transformers model, [B, n, V]."""
    with torch.inference_mode():
        return hf(input_ids=tokens, attention_mask=torch.ones_like(tokens)).logits.float()


def full_forward(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of one causal forward of ``tokens`` ([B, n]) on a fresh cache."""
    cache = model.new_cache(tokens.shape[1], batch=tokens.shape[0])
    return model(tokens, torch.arange(tokens.shape[1]), cache).logits


def random_tokens(n: int, seed: int = 0, vocab: int = TINY_VOCAB, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


# A branching draft tree, topologically ordered: node -> parent (-1 = child of the last prefix token).
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, -1, 7)


def tree_mask_and_depths(parents: tuple[int, ...]) -> tuple[torch.Tensor, list[int], list[list[int]]]:
    """(mask[i, j] = j is i or an ancestor of i, depth of each node, root-to-node paths)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        path = [*paths[p], i] if p >= 0 else [i]
        paths.append(path)
        mask[i, path] = True
    return mask, [len(p) - 1 for p in paths], paths


@pytest.fixture(scope="session")
def tiny_llama() -> TinyPair:
    return tiny_models("llama", seed=1, max_position_embeddings=48)


# -- the tiny speculative-decoding target (64 ids) and a random draft head for it ----------------
@pytest.fixture(scope="module")
def target() -> Transformer:
    """The adaptation, vocabulary and overlap tests' target; a module that needs another one
    (another seed or sharpness) defines its own ``target``."""
    return tiny_target(3)


@pytest.fixture(scope="module")
def head(target: Transformer) -> EagleHead:
    """A random EAGLE head for ``target``, shared read-only by a module's decoders."""
    return new_eagle_for(target, seed=1)


# -- the real default model (SmolLM2-135M-Instruct), shared by the whole session -----------------
@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    from evospec.models.loading import load_model
    from evospec.models.registry import DEFAULT_MODEL

    return load_model(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def hf_default(default_model: LoadedModel) -> Iterator[Any]:
    """transformers' model loaded from the converted cache folder of the default model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model.source), dtype=torch.float32).eval()
    yield model


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_model: LoadedModel) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model.source))

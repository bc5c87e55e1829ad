"""GGUF reader: metadata -> config, tensor names, llama q/k un-permutation, Gemma norms, errors."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from evospec.models.config import UnsupportedModelError
from evospec.models.errors import CheckpointError
from evospec.models.gguf_loader import _our_name, _unpermute, read_gguf
from evospec.models.loading import build_model, load_model
from tests.conftest import TinyPair, full_forward, hf_logits, random_tokens, tiny_models
from tests.models.gguf_writer import llama_cpp_permute, write_gguf

TOL = 1e-4

# llama without rope scaling (llama.cpp stores llama3 scaling as a tensor; tested separately below);
# gemma3 with 6 layers so llama.cpp's fixed "every 6th layer is global" pattern applies.
GGUF_CASES = {
    "llama": {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
    "qwen2": {},
    "qwen3": {},
    "gemma3": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def gguf_pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[TinyPair, Path]:
    family = request.param
    pair = tiny_models(family, seed=31, **GGUF_CASES[family])
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{family}.gguf"
    write_gguf(path, pair.cfg, pair.ours.state_dict())
    return pair, path


def test_read_gguf_reproduces_state_dict_and_config(gguf_pair: tuple[TinyPair, Path]) -> None:
    pair, path = gguf_pair
    cfg, state = read_gguf(path, progress=False)
    assert cfg.rms_norm_eps == pytest.approx(pair.cfg.rms_norm_eps, rel=1e-6)  # stored as float32
    assert cfg.to_dict() | {"rms_norm_eps": 0} == pair.cfg.to_dict() | {"rms_norm_eps": 0}
    expected = pair.ours.state_dict()
    if pair.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(state) == set(expected)
    for name, w in expected.items():
        assert state[name].dtype == torch.float32
        assert torch.allclose(state[name], w, atol=1e-6), name


def test_gguf_model_matches_transformers(gguf_pair: tuple[TinyPair, Path]) -> None:
    pair, path = gguf_pair
    cfg, state = read_gguf(path, progress=False)
    model = build_model(cfg, state, path)
    tokens = random_tokens(20, seed=32)
    assert (full_forward(model, tokens) - hf_logits(pair.hf, tokens)).abs().max() <= TOL


def test_quantised_gguf_dequantises_like_gguf_package(tmp_path: Path) -> None:
    import gguf

    pair = tiny_models("qwen2", seed=33)
    path = tmp_path / "q8.gguf"
    write_gguf(path, pair.cfg, pair.ours.state_dict(), quant=gguf.GGMLQuantizationType.Q8_0)
    _, state = read_gguf(path, progress=False)
    w = pair.ours.state_dict()["layers.1.mlp.up_proj.weight"]
    got = state["layers.1.mlp.up_proj.weight"]
    q = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.numpy(), expected)
    assert 0 < (got - w).abs().max() <= 0.02 * w.abs().max()


@pytest.mark.parametrize(("rows", "cols", "n_head"), [(64, 8, 4), (32, 8, 2), (12, 3, 3)])
def test_unpermute_inverts_llama_cpp_permutation(rows: int, cols: int, n_head: int) -> None:
    w = torch.randn(rows, cols)
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), n_head))
    assert not torch.equal(permuted, w)
    assert torch.equal(_unpermute(permuted, n_head), w)


@pytest.mark.parametrize(
    ("gguf_name", "family", "ours"),
    [
        ("token_embd.weight", "llama", "embed_tokens.weight"),
        ("output_norm.weight", "qwen3", "norm.weight"),
        ("output.weight", "llama", "lm_head.weight"),
        ("blk.3.attn_q.bias", "qwen2", "layers.3.self_attn.q_proj.bias"),
        ("blk.0.attn_k_norm.weight", "qwen3", "layers.0.self_attn.k_norm.weight"),
        ("blk.11.attn_norm.weight", "llama", "layers.11.input_layernorm.weight"),
        ("blk.2.ffn_norm.weight", "llama", "layers.2.post_attention_layernorm.weight"),
        ("blk.2.ffn_norm.weight", "gemma3", "layers.2.pre_feedforward_layernorm.weight"),
        ("blk.2.post_attention_norm.weight", "gemma3", "layers.2.post_attention_layernorm.weight"),
        ("blk.2.post_ffw_norm.weight", "gemma3", "layers.2.post_feedforward_layernorm.weight"),
        ("blk.5.ffn_down.weight", "gemma3", "layers.5.mlp.down_proj.weight"),
    ],
)
def test_tensor_name_mapping(gguf_name: str, family: str, ours: str) -> None:
    assert _our_name(gguf_name, family) == ours


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "mystery"])
def test_unknown_tensor_name_raises(name: str) -> None:
    with pytest.raises(CheckpointError, match="unknown GGUF tensor"):
        _our_name(name, "llama")


def test_missing_gguf_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(CheckpointError, match="not found") as info:
        read_gguf(path, progress=False)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError) as info:
        load_model(path, progress=False)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_gguf_raises_checkpoint_error(
    damage: str, gguf_pair: tuple[TinyPair, Path], tmp_path: Path
) -> None:
    _, good = gguf_pair
    data = good.read_bytes()
    path = tmp_path / f"{damage}.gguf"
    path.write_bytes(
        {"truncate": data[: len(data) // 2], "garbage": b"\x13\x37" * 4096, "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError) as info:
        read_gguf(path, progress=False)
    assert str(path) in str(info.value)
    with pytest.raises(CheckpointError) as info:  # the loader entry point says the same
        load_model(path, progress=False)
    assert str(path) in str(info.value)


def test_unsupported_gguf_architecture_names_file_and_arch(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="gpt2") as info:
        read_gguf(path, progress=False)
    assert str(path) in str(info.value)


def _llama3_rope_factors(cfg_rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """The ``rope_freqs.weight`` tensor llama.cpp's converter writes for llama3 rope scaling."""
    factor, low, high = cfg_rope["factor"], cfg_rope["low_freq_factor"], cfg_rope["high_freq_factor"]
    old = cfg_rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_gguf(tmp_path: Path) -> None:
    pair = tiny_models("llama", seed=34)  # llama3 rope scaling
    assert pair.cfg.rope_scaling is not None
    factors = _llama3_rope_factors(pair.cfg.rope_scaling, pair.cfg.head_dim, pair.cfg.rope_theta)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, pair.cfg, pair.ours.state_dict(), extra_tensors={"rope_freqs.weight": factors})
    cfg, state = read_gguf(path, progress=False)
    tokens = random_tokens(40, seed=35)
    assert (
        full_forward(build_model(cfg, state, path), tokens) - hf_logits(pair.hf, tokens)
    ).abs().max() <= TOL


def test_f32_gguf_weights_are_writable(tmp_path: Path) -> None:
    pair = tiny_models("qwen2", seed=36)
    path = tmp_path / "f32.gguf"
    write_gguf(path, pair.cfg, pair.ours.state_dict())
    code = (
        "import torch\n"
        "from evospec.models.gguf_loader import read_gguf\n"
        f"cfg, state = read_gguf({str(path)!r}, progress=False)\n"
        "with torch.no_grad():\n"
        "    for t in state.values():\n"
        "        t.add_(1.0)\n"
        "print('ok')\n"
    )
    # In a subprocess: the failure mode is a segmentation fault.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]

"""EAGLE-2 head checkpoints: the public key layout loads unchanged; saves reload bit-exactly."""

from __future__ import annotations

import json

import pytest
import torch

from evospec.models.eagle import load_eagle, new_eagle_for, save_eagle, widen_mlp
from evospec.models.errors import CheckpointError
from tests.decoding.spec_helpers import tiny_target

D, V, FF, H, KV = 32, 64, 64, 4, 2


def eagle_style_folder(tmp_path, *, bias: bool, embed: bool, qkv_bias: bool = False, fmt: str = "bin"):
    """A checkpoint exactly as EAGLE-2 publishes them (names and shapes), at tiny size."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    state = {
        "fc.weight": r(D, 2 * D),
        "layers.0.self_attn.q_proj.weight": r(H * 8, D),
        "layers.0.self_attn.k_proj.weight": r(KV * 8, D),
        "layers.0.self_attn.v_proj.weight": r(KV * 8, D),
        "layers.0.self_attn.o_proj.weight": r(D, H * 8),
        "layers.0.mlp.gate_proj.weight": r(FF, D),
        "layers.0.mlp.up_proj.weight": r(FF, D),
        "layers.0.mlp.down_proj.weight": r(D, FF),
        "layers.0.post_attention_layernorm.weight": 1 + r(D),
    }
    if bias:
        state["fc.bias"] = r(D)
    if embed:
        state["embed_tokens.weight"] = r(V, D)
    if qkv_bias:
        for n in ("q", "k", "v"):
            state[f"layers.0.self_attn.{n}_proj.bias"] = r(
                state[f"layers.0.self_attn.{n}_proj.weight"].shape[0]
            )
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": FF,
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 160,
        "hidden_act": "silu",
        "bias": bias,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(tmp_path / "model.safetensors"))
    return state


@pytest.mark.parametrize(
    "bias,embed,qkv_bias,fmt",
    [
        (True, False, False, "bin"),
        (False, True, False, "safetensors"),
        (True, True, True, "bin"),
    ],
)
def test_public_layout_loads_unchanged(tmp_path, bias, embed, qkv_bias, fmt):
    state = eagle_style_folder(tmp_path, bias=bias, embed=embed, qkv_bias=qkv_bias, fmt=fmt)
    head = load_eagle(tmp_path).attach(tiny_target(0))
    loaded = head.state_dict()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    assert head.layers[0].input_layernorm is None  # EAGLE-2's first layer has no input norm
    assert (head.embed_tokens is not None) == embed


def test_forward_uses_embedding_then_feature(tmp_path):
    """fc sees concat[embedding(token), feature] in that order."""
    eagle_style_folder(tmp_path, bias=True, embed=True)
    head = load_eagle(tmp_path)
    feats = torch.randn(1, 3, D)
    tokens = torch.tensor([[1, 2, 3]])
    x = head.fc(torch.cat([head.embed_tokens(tokens), feats], -1))
    swapped = head.fc(torch.cat([feats, head.embed_tokens(tokens)], -1))
    assert not torch.allclose(x, swapped)
    cache = head.new_cache(8)
    out = head(feats, tokens, torch.arange(3), cache, None)
    assert out.shape == (1, 3, D) and cache.length == 3


def test_save_reloads_bit_exactly(tmp_path):
    target = tiny_target(0)
    head = new_eagle_for(target, seed=3)
    save_eagle(head, tmp_path / "h", dtype=torch.float16)
    again = load_eagle(tmp_path / "h")
    for k, v in head.state_dict().items():
        assert torch.equal(again.state_dict()[k], v.half().float()), k
    assert "embed_tokens.weight" not in again.state_dict()  # shared with the target, not saved
    save_eagle(again, tmp_path / "h2", dtype=torch.float16)
    third = load_eagle(tmp_path / "h2")
    for k, v in again.state_dict().items():
        assert torch.equal(third.state_dict()[k], v), k


def test_widened_mlp_drafts_as_before_and_trains_the_new_units(tmp_path):
    """widen_mlp grows the MLP without changing what the head computes; the new units get
    gradients once their down columns move, and the wider head saves and reloads."""
    target = tiny_target(0)
    head = new_eagle_for(target, seed=3)
    torch.nn.init.normal_(head.layers[0].mlp.down_proj.weight)  # make the old MLP matter
    old = head.cfg.intermediate_size
    wide = widen_mlp(head, 3 * old, seed=1)
    assert wide.cfg.intermediate_size == 3 * old and wide.layers[0].mlp.gate_proj.weight.shape[0] == 3 * old
    feats, tokens = torch.randn(1, 5, D), torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        a = head(feats, tokens, torch.arange(5), head.new_cache(8), None)
        b = wide(feats, tokens, torch.arange(5), wide.new_cache(8), None)
    # the same products; BLAS may block a wider down projection's sums differently: a few ulps
    # (2.9e-6 of ~8 on an Intel Xeon with AVX-512, exact on a Zen 4)
    torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert wide.layers[0].mlp.up_proj.weight[old:].abs().sum() > 0  # the new rows are not dead
    loss = wide(feats, tokens, torch.arange(5), wide.new_cache(8), None).square().sum()
    loss.backward()
    assert wide.layers[0].mlp.down_proj.weight.grad[:, old:].abs().sum() > 0
    save_eagle(wide, tmp_path / "w", dtype=torch.float32)
    again = load_eagle(tmp_path / "w").attach(target)
    assert again.cfg.intermediate_size == 3 * old
    with torch.no_grad():
        torch.testing.assert_close(again(feats, tokens, torch.arange(5), again.new_cache(8), None), b)
    with pytest.raises(ValueError, match="already has"):
        widen_mlp(head, old)


def test_mismatched_target_is_a_clear_error(tmp_path):
    eagle_style_folder(tmp_path, bias=True, embed=False)
    head = load_eagle(tmp_path)
    from dataclasses import replace

    from evospec.models.transformer import Transformer

    wide = Transformer(replace(tiny_target(0).cfg, hidden_size=48, head_dim=12))
    with pytest.raises(ValueError, match="hidden size"):
        head.attach(wide)
    big_vocab = Transformer(replace(tiny_target(0).cfg, vocab_size=V + 1))
    with pytest.raises(ValueError, match="vocabulary"):
        head.attach(big_vocab)


def test_missing_or_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_eagle(tmp_path)
    eagle_style_folder(tmp_path, bias=True, embed=False)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        load_eagle(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or pytorch_model\.bin"):
        load_eagle(tmp_path)

"""Write tiny GGUF files the way llama.cpp's converter lays them out (test helper)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from evospec.models.config import ModelConfig

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for llama (HF rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str, family: str) -> str:
    """HF/our parameter name -> llama.cpp tensor name."""
    if name == "embed_tokens.weight":
        return "token_embd.weight"
    if name == "norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    m = _LAYER_RE.match(name)
    assert m, name
    layer, part, kind = m.groups()
    if part == "post_attention_layernorm":
        short = "post_attention_norm" if family == "gemma3" else "ffn_norm"
    else:
        short = _LAYER[part]
    return f"blk.{layer}.{short}.{kind}"


def write_gguf(
    path: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    quant: Any = None,  # a gguf.GGMLQuantizationType for the 2-D weights, None = F32
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_kv: dict[str, float] | None = None,
) -> None:
    """``state`` uses our names (no ``model.`` prefix); ``cfg`` supplies the metadata."""
    import gguf

    arch = cfg.family
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    if cfg.is_gemma and cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    for key, value in (extra_kv or {}).items():
        w.add_float32(key, value)
    for name, t in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = llama_cpp_permute(arr, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if cfg.is_gemma and "norm" in name:
            arr = arr + 1.0  # llama.cpp stores Gemma's (1 + w)
        if quant is not None and arr.ndim == 2:
            w.add_tensor(gguf_name(name, arch), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(name, arch), arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

"""Read a GGUF checkpoint into a :class:`ModelConfig` and a float state dict.

Owns: GGUF metadata -> config, GGUF tensor names -> our parameter names, dequantisation
(via the ``gguf`` package), the 4-bit codes of Q4_0 / Q4_1 blocks as they are (for the int4
weight format), and the two layout changes llama.cpp's converter applies (Llama q/k rows
permuted for its RoPE kernel; Gemma norm weights stored as ``1 + w``). Knows
nothing about tokenizers; see ``loading.py`` for that.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from evospec.models.config import ModelConfig, UnsupportedModelError
from evospec.models.errors import CheckpointError
from evospec.models.quant import GROUP, GroupCodes

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _open(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors
        raise CheckpointError(path, f"not a readable GGUF file (truncated or corrupt?): {exc}") from exc


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    family = _GGUF_ARCH.get(arch or "")
    if family is None:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCH)}"
        )
    a = arch
    heads = int(_field(reader, f"{a}.attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    head_dim = int(_field(reader, f"{a}.attention.key_length", hidden // heads))
    n_layers = int(_field(reader, f"{a}.block_count"))
    vocab = _field(reader, f"{a}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    has_qkv_bias = any(t.name == "blk.0.attn_q.bias" for t in reader.tensors)
    kw: dict[str, Any] = {}
    if family == "gemma3":
        pattern = 6  # llama.cpp's fixed Gemma3 layout: every 6th layer is global
        kw = dict(
            sliding_window=int(_field(reader, f"{a}.attention.sliding_window", 4096)),
            layer_types=tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)
            ),
            rope_local_base_freq=10_000.0,
            # llama.cpp's rule: Gemma3-27B (62 layers) scales by hidden/heads, the others by head_dim
            query_pre_attn_scalar=float(hidden // heads if n_layers == 62 else head_dim),
            hidden_act="gelu_pytorch_tanh",
        )
    scale_type = _field(reader, f"{a}.rope.scaling.type")
    rope_scaling = None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama.cpp's form of llama3 scaling: one divisor per frequency
        factors = np.array(freqs.data, dtype=np.float32).reshape(-1).tolist()
        rope_scaling = {"rope_type": "freq_factors", "factors": factors}
    elif scale_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{a}.rope.scaling.factor"))}
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 2048)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10_000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=not has_output,
        attention_bias=has_qkv_bias,
        qk_norm=family in ("qwen3", "gemma3"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        **kw,
    )


def _our_name(gguf_name: str, family: str) -> str:
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part == "ffn_norm":
            target = "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
        elif part in _LAYER_NAMES:
            target = _LAYER_NAMES[part]
        else:
            raise CheckpointError(None, f"unknown GGUF tensor {gguf_name!r}")
        return f"layers.{layer}.{target}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise CheckpointError(None, f"unknown GGUF tensor {gguf_name!r}")


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of q/k rows (its RoPE pairs adjacent dims)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def read_gguf(path: str | Path, *, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantise every tensor of a GGUF file into float32, named like our Transformer."""
    import gguf

    path = Path(path)
    reader = _open(path)
    cfg = gguf_config(reader, path)
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"reading {path.name}", unit="tensor", disable=not progress):
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise CheckpointError(path, f"cannot dequantise tensor {t.name}: {exc}") from exc
        if t.name == "rope_freqs.weight":  # llama3 RoPE scaling, already in cfg.rope_scaling
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        # Always copy: F32 tensors would otherwise alias the reader's read-only memory map.
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).reshape(shape)
        name = _our_name(t.name, cfg.family)
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if cfg.family == "gemma3" and "norm" in name:
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w); our RMSNorm adds the 1 itself
        state[name] = w
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return cfg, state


# Bytes per 32-weight block and the offset of its packed nibbles: Q4_0 = fp16 d + 16 bytes;
# Q4_1 = fp16 d, fp16 m + 16 bytes. Byte j of a block holds weight j (low nibble) and j + 16.
_Q4_BLOCKS = {"Q4_0": (18, 2), "Q4_1": (20, 4)}


def _block_codes(raw: np.ndarray, kind: str, rows: int, cols: int) -> GroupCodes:
    """GGUF Q4_0 / Q4_1 rows ([rows, bytes] uint8) -> group codes with the same 4-bit values."""
    size, offset = _Q4_BLOCKS[kind]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, blocks]
    nibbles = blocks[..., offset:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, cols)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d  # d * q + m = (q - 8) * d + (m + 8 d)
    else:
        zero = np.zeros_like(d)  # d * (q - 8)
    return GroupCodes(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(zero))


def read_gguf_codes(path: str | Path) -> dict[str, GroupCodes]:
    """The 4-bit codes of every Q4_0 / Q4_1 weight in a GGUF file, named like our Transformer.

    Used by the int4 weight format so those weights run on exactly the GGUF's codes (no
    re-quantisation); other tensors are not returned. Llama q/k rows are un-permuted as in
    :func:`read_gguf`.
    """
    path = Path(path)
    reader = _open(path)
    cfg = gguf_config(reader, path)
    out: dict[str, GroupCodes] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in _Q4_BLOCKS or len(t.shape) != 2:
            continue
        cols, rows = (int(x) for x in t.shape)
        codes = _block_codes(np.asarray(t.data), kind, rows, cols)
        name = _our_name(t.name, cfg.family)
        if cfg.family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
            codes = codes.rows(_unpermute(torch.arange(rows), heads))
        out[name] = codes
    return out

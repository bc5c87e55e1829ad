"""Compact decoder-only target transformer (Llama, Qwen2, Qwen3, Gemma3 text).

Owns: the modules and the forward pass. ``forward(tokens, positions, cache, tree_mask)``
appends the new tokens' keys/values to an explicit :class:`KVCache`, attends over the
committed prefix plus the new tokens (causally, or through an [n, n] tree mask), and returns
logits plus the features a draft head needs. Module and parameter names follow the Hugging
Face checkpoint layout (minus the ``model.`` prefix) so weights load by name.

It knows nothing about files, tokenizers or decoding policies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from evospec.models.config import ModelConfig
from evospec.models.fused import run_fused_layers, tree_bits
from evospec.models.kv_cache import KVCache
from evospec.models.packing import PackedMatmul
from evospec.models.quant import QuantMatmul
from evospec.models.rope import RotaryTable
from evospec.models.step import StepGraph


@dataclass
class ForwardOutput:
    """What one target forward returns."""

    logits: torch.Tensor | None  # [B, n_out, V] (n_out = n, or 1 with last_only)
    hidden: torch.Tensor  # [B, n, D] final-layer features after the final norm (EAGLE-2 input)
    aux_hidden: list[torch.Tensor]  # per requested layer: [B, n, D] that layer's output


class RMSNorm(nn.Module):
    """RMSNorm in float32; Gemma multiplies by (1 + w), the others by w."""

    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.offset and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {
        "gate_up": ("gate_proj", "up_proj")
    }  # set by models.packing.pack_linears

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up: PackedMatmul | QuantMatmul | None = None  # one packed call for gate and up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class Attention(nn.Module):
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("q_proj", "k_proj", "v_proj")
    }  # set by models.packing.pack_linears

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attn_scale
        self.sliding = cfg.is_sliding(layer)
        # keys a query sees at most on a sliding layer, where the fused attention op hides the
        # rest itself (the eager path's masks do it otherwise); 0: a global layer
        self.window = int(cfg.sliding_window) if self.sliding and cfg.sliding_window else 0
        d, hd = cfg.hidden_size, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: PackedMatmul | QuantMatmul | None = None  # one packed call for q, k and v

    def forward(
        self,
        x: torch.Tensor,  # [B, n, D]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [n, Dh]
        cache: KVCache,
        mask: torch.Tensor | None,  # [n, P+n] bool, True = attend; None = causal/no mask
        rows: list[RowAttention] | None = None,  # set: attend row by row, as one-token steps do
    ) -> torch.Tensor:
        b, n, _ = x.shape
        if self.qkv is not None and self.q_norm is None:
            q, k, v = self._fused_qkv_rope(self.qkv(x), cos_sin)
        else:
            if self.qkv is not None:
                q, k, v = self.qkv(x).split(self.qkv.sizes, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = self._rope_qkv(q, k, v, cos_sin)
        out = self.attend_rotated(q, k, v, cache, mask, rows)  # [B, H, n, Dh]
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def attend_rotated(
        self,
        q: torch.Tensor,  # [B, H, n, Dh], rotated
        k: torch.Tensor,  # [B, H_kv, n, Dh], rotated
        v: torch.Tensor,  # [B, H_kv, n, Dh]
        cache: KVCache,
        mask: torch.Tensor | None,
        rows: list[RowAttention] | None,
        fused: bool = False,
        sliding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write k/v into the cache and attend (all rows at once, or row by row): [B, H, n, Dh].
        ``fused``: attention runs as the fused CPU op (``fused.py``'s models), which takes the
        full-attention ``mask`` and, on a sliding layer, hides the keys past the window itself;
        ``sliding_mask`` (that layer's own mask) then serves only SDPA's masked multi-row
        fallback. Unfused, ``mask`` is the layer's own."""
        keys, values = cache.write(self.layer, k, v)  # [B, H_kv, P+n, Dh]
        if not (fused and self.window):
            sliding_mask = mask
        if rows is None:
            return self._attend(q, keys, values, mask, fused, sliding_mask)
        kind = self.sliding and not fused  # which of a row's masks: the op windows by itself
        if fused and all(r.index is None and r.masks[kind] is None for r in rows):
            # a chain: row j sees the cache and rows 0..j, as the op's rows do; one call, the
            # bits of one call per row
            return torch.ops.evospec.decode_attention(q, keys, values, None, self.scale, self.window)
        prefix, tree, parts = 0, None, []  # tree: the new slots' K/V, kept aside once a row moves them
        for j, row in enumerate(rows):
            if row.index is not None and tree is None:
                prefix = keys.shape[2] - q.shape[2]
                tree = keys[:, :, prefix:].clone(), values[:, :, prefix:].clone()  # [B, H_kv, n, Dh]
            if tree is not None:  # the row's visible new slots right behind the prefix, in depth order
                seen = row.index if row.index is not None else slice(0, j + 1)
                keys[:, :, prefix : row.end] = tree[0][:, :, seen]
                values[:, :, prefix : row.end] = tree[1][:, :, seen]
            row_k, row_v = row.keys(keys, values)  # as plain decoding lays them out
            parts.append(
                self._attend(
                    q[:, :, j : j + 1], row_k, row_v, row.masks[kind], fused, row.masks[self.sliding]
                )
            )
        if tree is not None:  # the cache as the forward wrote it
            keys[:, :, prefix:], values[:, :, prefix:] = tree
        return torch.cat(parts, dim=2)

    def _attend(self, q, keys, values, mask, fused=False, sdpa_mask=None) -> torch.Tensor:
        """q [B, H, n, Dh] -> same. ``sdpa_mask``: what SDPA takes where the op cannot serve a
        fused forward (default: ``mask``)."""
        if fused and (q.shape[2] == 1 or mask is None):
            # one query, or causal rows (a prefill): row j attends with the call a one-token
            # step at its position makes, so a prefill writes bitwise the K/V and logits that
            # decoding the prompt token by token would (what prefix reuse relies on)
            one = q.shape[2] == 1
            return torch.ops.evospec.decode_attention(
                q, keys, values, mask if one else None, self.scale, self.window
            )
        if fused and sdpa_mask is not None:
            mask = sdpa_mask
        if keys.dtype != q.dtype:  # an f16 cache (fused models) under a masked multi-row forward
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            # only valid when the prefix is empty; recorded graphs (step.py) attend one query row per call
            is_causal=mask is None and not torch.jit.is_tracing() and q.shape[2] > 1,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )

    def _fused_qkv_rope(
        self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection's output [B, n, (H + 2 H_kv) Dh] -> rotated q, k and v, each
        [B, heads, n, Dh]. q and k are rotated in one pass over their shared slice (same
        result as rotating each: RoPE is per head)."""
        b, n, _ = qkv.shape
        hq, hk, dh = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[..., : (hq + hk) * dh].view(b, n, hq + hk, dh)
        cos, sin = cos_sin  # [n, Dh] or [B, 1, n, Dh] (per-row positions)
        if cos.dim() == 2:
            qk = _apply_rope(qk, cos[:, None], sin[:, None])  # heads on dim 2
        else:
            qk = _apply_rope(qk.transpose(1, 2), cos, sin).transpose(1, 2)
        q = qk[:, :, :hq].transpose(1, 2)
        k = qk[:, :, hq:].transpose(1, 2)
        v = qkv[..., (hq + hk) * dh :].view(b, n, hk, dh).transpose(1, 2)
        return q, k, v

    def _rope_qkv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Separate q [B, n, H Dh], k, v [B, n, H_kv Dh] -> (q/k-normed) rotated [B, heads, n, Dh]."""
        b, n, _ = q.shape
        q = q.view(b, n, self.num_heads, self.head_dim)
        k = k.view(b, n, self.num_kv_heads, self.head_dim)
        v = v.view(b, n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, n, Dh]
        cos, sin = cos_sin
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, off)
        self.sandwich = cfg.is_gemma  # Gemma3: norms before and after both sublayers
        self.fused_norms = None  # Gemma on the fused ops: its norms' 1 + w (fused.GemmaNorms)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, off)

    def forward(self, x, cos_sin, cache, mask, rows=None) -> torch.Tensor:
        if self.sandwich:
            h = self.self_attn(self.input_layernorm(x), cos_sin, cache, mask, rows)
            x = x + self.post_attention_layernorm(h)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(h)
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, cache, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The target model. Parameter names match HF checkpoints without the ``model.`` prefix."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # True: a forward of n > 1 new tokens after a prefix (tree verification) attends row by
        # row with the call a one-token step makes at that position, so every row's logits are
        # bitwise those of plain decoding (the linear kernels and norms already are row-exact).
        # Costs n attention calls per layer instead of one; set by load_model on the CPU.
        self.exact_rows = False
        # Set (load_model, on the CPU): one-token steps and row-exact chain verifications of one
        # sequence run through recorded graphs, the same kernels without Python's per-op cost
        # (models/step.py).
        self.step_graph: StepGraph | None = None
        # Set (load_model, on the CPU, where fused.supports_fused_ops): every forward runs its
        # blocks through the fused CPU ops (one decision per model, so all methods agree).
        self.fused_ops = False
        # The KV cache's element type; None: the parameters' (set to float16 with the fused ops:
        # their attention reads f16 K/V, half the bytes a step streams, as llama.cpp's default).
        self.kv_dtype: torch.dtype | None = None
        self.reset_rope()

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)build the RoPE tables, e.g. after constructing on the meta device."""
        cfg = self.cfg
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.rope_global = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            self.rope_local = RotaryTable(cfg.head_dim, cfg.rope_local_base_freq, None)

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live (its final norm's: a norm stays dense in every format)."""
        return self.norm.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        p = self.norm.weight  # the model's dtype and device (the embedding may be int8 codes)
        return KVCache(
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            max_len,
            batch=batch,
            dtype=self.kv_dtype or p.dtype,
            device=p.device,
        )

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, n] token ids
        positions: torch.Tensor,  # [n] absolute positions of the new tokens
        cache: KVCache,
        tree_mask: torch.Tensor | None = None,  # [n, n] bool: new token i may see new token j
        *,
        attn_mask: torch.Tensor | None = None,  # [n, prefix + n] bool over all slots (overrides)
        left_pad: torch.Tensor | None = None,  # [B] leading pad slots per row (batched prompts)
        logits: str = "all",  # "all" | "last" | "none"
        aux_layers: tuple[int, ...] = (),
        tree_rows: torch.Tensor | None = None,  # [n] int64: tree_mask's rows as bit sets, if known
    ) -> ForwardOutput:
        """Append ``tokens`` to ``cache`` (advancing it by n) and return logits and features.

        Committed cache slots are visible to every new token; among the new tokens
        ``tree_mask`` (default: causal) decides. ``attn_mask`` instead spells out visibility
        of every slot, for callers that keep uncommitted tree slots in the cache (drafters).
        ``tree_rows``: ``fused.tree_bits(tree_mask)``, where the caller has it (a recorded tree
        forward takes the bits; computing them costs ~0.1 ms of small ops after a forward).
        """
        cfg = self.cfg
        n = tokens.shape[1]
        prefix = cache.length
        graph = self.step_graph
        tree = graph is not None and graph.takes_tree(n, aux_layers)
        if tree and self._tree_recordable(tokens, tree_mask, attn_mask, left_pad, logits):
            bits = tree_rows if tree_rows is not None else tree_bits(tree_mask)
            stepped = graph(tokens, positions, cache, logits, aux_layers, tree=bits)
            if stepped is not None:
                cache.advance(n)
                return ForwardOutput(logits=stepped[0], hidden=stepped[1], aux_hidden=stepped[2])
        rows = None
        if self.exact_rows and n > 1 and prefix > 0 and attn_mask is None and left_pad is None:
            rows = row_attention(cfg, prefix, positions, tree_mask, tokens.device)
        if graph is not None and self._recordable(tokens, tree_mask, rows, attn_mask, left_pad, logits):
            stepped = graph(tokens, positions, cache, logits, aux_layers)  # None: no graph, run eagerly
            if stepped is not None:
                cache.advance(n)
                return ForwardOutput(logits=stepped[0], hidden=stepped[1], aux_hidden=stepped[2])
        x = self.embed_tokens(tokens)
        if cfg.embed_scale != 1.0:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        if attn_mask is not None:
            if any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
                raise NotImplementedError("attn_mask with sliding-window layers")
            masks = {False: attn_mask, True: attn_mask}
        else:
            masks = _build_masks(cfg, prefix, positions, tree_mask, x.device)
        rope_pos = positions
        if left_pad is not None:  # rows are right-aligned: position = slot - pad
            masks = {k: _mask_padding(m, left_pad, prefix, n) for k, m in masks.items()}
            rope_pos = (positions[None] - left_pad[:, None]).clamp(min=0)  # [B, n]
        rope_g = self.rope_global(rope_pos, x.dtype)
        rope_l = self.rope_local(rope_pos, x.dtype) if cfg.is_gemma else rope_g
        x, aux = self.run_layers(x, (rope_g, rope_l), cache, masks, rows, aux_layers)
        cache.advance(n)
        hidden = self.norm(x)
        out_logits = None
        if logits != "none":
            out_logits = self.project_logits(hidden[:, -1:] if logits == "last" else hidden)
        return ForwardOutput(logits=out_logits, hidden=hidden, aux_hidden=aux)

    def run_layers(
        self,
        x: torch.Tensor,  # [B, n, D] embedded tokens
        ropes: tuple,  # (global, local) cos/sin tables for these positions
        cache,
        masks: dict[bool, torch.Tensor | None],  # by layer kind: sliding or not
        rows: list[RowAttention] | None,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder blocks: x -> (last block's output [B, n, D], the outputs of layers
        ``aux_layers``, one per entry). The one loop both the eager forward and the recorded steps run; with
        ``fused_ops`` set it runs through the fused CPU ops (``fused.py``)."""
        if self.fused_ops:
            return run_fused_layers(self, x, ropes, cache, masks, rows, aux_layers)
        seen: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            sliding = self.cfg.is_sliding(i)
            x = block(x, ropes[sliding], cache, masks[sliding], rows)
            if i in aux_layers:
                seen[i] = x
        return x, [seen[i] for i in aux_layers]  # in the order asked, repeats included

    @staticmethod
    def _recordable(tokens, tree_mask, rows, attn_mask, left_pad, logits) -> bool:
        """One sequence, and either one token or a row-exact chain (every row sees the cache
        and the rows before it) that verifies (all or no rows' logits): the forwards
        ``step_graph`` records. A prompt's rest after reused slots (``logits="last"``) runs
        eagerly: its lengths vary, and each would record a graph of its own."""
        if tokens.shape[0] != 1 or attn_mask is not None or left_pad is not None:
            return False
        if tokens.shape[1] == 1:
            return tree_mask is None
        return logits != "last" and rows is not None and all(r.index is None for r in rows)

    @staticmethod
    def _tree_recordable(tokens, tree_mask, attn_mask, left_pad, logits) -> bool:
        """A draft tree of one sequence that verifies (all or no rows' logits): what a step
        graph with ``trees`` records (``fused.TreeRows``; row-exact by the op's attention)."""
        if tree_mask is None or tokens.shape[0] != 1 or tokens.shape[1] == 1:
            return False
        return attn_mask is None and left_pad is None and logits != "last"

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final features [..., D] -> logits [..., V]: the LM head, then soft-capping if any.

        What ``forward`` applies to its ``hidden``; callers that project some rows later
        (lazy verification) run the same function on them (equal up to GEMM rounding).
        """
        out = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out


@dataclass(frozen=True)
class RowAttention:
    """How one new token attends in a row-exact forward: the cache slots it sees, laid out as
    plain decoding lays them out at its position (slots 0..pos), and the masks a one-token
    step at that position uses (by layer kind: sliding or not)."""

    end: int  # its position + 1: it sees slots [0, end) as plain decoding lays them out
    # None: those are the cache's own slots (causal rows); else the new slots it sees (its tree
    # ancestors and itself, in depth order, as offsets from the first new slot), which the
    # attention moves right behind the cache's prefix for the row (``Attention.attend_rotated``)
    index: torch.Tensor | None
    masks: dict[bool, torch.Tensor | None]

    def keys(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Its keys and values: the first ``end`` slots (a view)."""
        return keys[:, :, : self.end], values[:, :, : self.end]


def row_attention(
    cfg: ModelConfig,
    prefix: int,
    positions: torch.Tensor,  # [n]
    tree_mask: torch.Tensor | None,  # [n, n] bool; None = causal
    device: torch.device,
) -> list[RowAttention] | None:
    """Per-row plans for a row-exact forward, or None when a row's position does not match
    its visible tokens (not a tree verification: attend in one call)."""
    n = positions.shape[0]
    if tree_mask is None:  # causal rows: a chain right behind the cache, or not a verification
        pos = positions.tolist()
        if pos != list(range(prefix, prefix + n)):
            return None
        return [
            RowAttention(p + 1, None, _build_masks(cfg, p, positions[j : j + 1], None, device))
            for j, p in enumerate(pos)
        ]
    visible = tree_mask.cpu().bool()
    out = []
    for j, pos in enumerate(positions.tolist()):  # one host copy above; n <= the tree size
        seen = visible[j].nonzero()[:, 0]  # new slots row j sees, in slot (= depth) order
        if pos != prefix + seen.numel() - 1:
            return None
        masks = _build_masks(cfg, pos, positions[j : j + 1], None, device)  # a one-token step's
        chain = seen.numel() == j + 1 and int(seen[-1]) == j  # slots 0..j: a view of the cache
        out.append(RowAttention(pos + 1, None if chain else seen.to(device), masks))
    return out


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, H, n, Dh], cos/sin [n, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _mask_padding(mask: torch.Tensor | None, left_pad: torch.Tensor, prefix: int, n: int) -> torch.Tensor:
    """[B, 1, n, prefix + n]: ``mask`` (None = causal) minus each row's leading pad slots.

    A pad query still sees itself, so no row of the softmax is empty (its output is unused).
    """
    device = left_pad.device
    if mask is None:
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=device).tril(prefix)
    slots = torch.arange(prefix + n, device=device)
    valid = slots[None, :] >= left_pad[:, None]  # [B, S]
    self_slot = slots[None, :] == (prefix + torch.arange(n, device=device))[:, None]  # [n, S]
    return (mask[None] & (valid[:, None, :] | self_slot[None]))[:, None]


def _build_masks(
    cfg: ModelConfig,
    prefix: int,
    positions: torch.Tensor,  # [n]
    tree_mask: torch.Tensor | None,  # [n, n]
    device: torch.device,
) -> dict[bool, torch.Tensor | None]:
    """Attention masks for full (False) and sliding (True) layers; None means "no mask".

    Committed slots are always visible (slot i holds position i); among the new tokens, the
    tree mask (or causality) decides. Sliding layers additionally hide keys whose position is
    ``sliding_window`` or more behind the query.
    """
    n = positions.shape[0]
    if tree_mask is None and (n == 1 or prefix == 0):
        full: torch.Tensor | None = None  # n == 1: attend to all; prefix == 0: is_causal
    else:
        new = (
            tree_mask.to(device=device, dtype=torch.bool)
            if tree_mask is not None
            else (torch.ones(n, n, dtype=torch.bool, device=device).tril())
        )
        full = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), new], dim=1)
    masks: dict[bool, torch.Tensor | None] = {False: full}
    window = cfg.sliding_window
    if cfg.is_gemma and window is not None:
        key_pos = torch.cat([torch.arange(prefix, device=device), positions.to(device)])
        if prefix + n - 1 < window:  # positions < prefix + n: no key can leave the window
            masks[True] = full
        else:
            base = (
                full
                if full is not None
                else (torch.ones(n, prefix + n, dtype=torch.bool, device=device).tril(prefix))
            )
            in_window = (positions.to(device)[:, None] - key_pos[None, :]) < window
            masks[True] = base & in_window
    else:
        masks[True] = full
    return masks

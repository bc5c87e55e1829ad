"""The decoder blocks through the fused CPU ops, for Llama-style and Gemma-3 models with quantised
linears.

Owns: :func:`supports_fused_ops` (which models qualify) and :func:`run_fused_layers`, the layer
loop ``Transformer.run_layers`` runs when ``Transformer.fused_ops`` is set. Per Llama layer:

    h = rms_norm(x) -> bf16          (the previous layer's add_rms_norm gives it)
    q, k, v = rope_qkv(qkv(h))       # [B, H, n, Dh] f32, rotated
    a = o_proj(attend(q, k, v))      # bf16
    x, h = add_rms_norm(x, a)        # x: f32 residual stream, h: bf16
    x, h = add_rms_norm(x, down(silu_mul(gate_up(h))))

The quantised matmuls take bf16 activations anyway, so the activations between them stay bf16
and the f32 residual stream is added exactly as before; norms, RoPE and SiLU run as the four
ops of ``kernels/cpu_ops.cpp``, which replace ~45 small aten calls per layer by 4 (casts,
norm pieces, RoPE slices), and one-query attention runs as its ``decode_attention``. The KV
cache and the row-by-row verification are the Transformer's own
(``Attention.attend_rotated``), so chains stay row-exact.

A Gemma-3 layer (:func:`_gemma_loop_layer`) norms each sublayer's output before adding it
(``norm_add_rms_norm_bf16``), norms the q/k heads before RoPE (``rope_qkv_normed``), gates its
MLP with GELU (``gelu_mul_bf16``), takes the local RoPE table on its sliding layers, and its
attention op hides the keys past the window itself (``decode_attention``'s ``window``), so a
step needs no position-dependent mask and can be recorded like a Llama one. Its norms scale by
1 + w, precomputed once (:class:`GemmaNorms`).

Where every linear runs our int4 kernel and the forward has no mask (recorded steps and chains,
a prefill's causal rows), each layer is one ``llama_layer`` / ``gemma_layer`` op: the same calls
in C++, so a recorded step replays one node per layer; a Llama model's layers (unless a caller
asks for intermediate layers' outputs) are one ``llama_stack`` op, which one team of threads runs
from the first layer to the last (``kernels/llama_layer.cpp``: no thread-pool start or dispatch
between the products).

The numbers differ from the unfused path only by rounding (one bf16 rounding where there were
two, our exp in SiLU): a model decides at load and then every forward -- prefill, steps,
chains, trees, batches, recorded or eager -- takes this path, so its methods agree bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from evospec.models.embedding import CompactEmbedding
from evospec.models.kv_cache import KVCache, SlotCache
from evospec.models.quant import Bf16Matmul, Int4Matmul, Int8Matmul, QuantLinear, quant_kernel

_BF16_INPUT = (Int4Matmul, Int8Matmul, Bf16Matmul)  # matmuls that cast their input to bf16


@dataclass(frozen=True)
class TreeRows:
    """The rows of a draft tree verified by one ``llama_stack`` op (a recorded tree forward,
    ``models/step.py``): row j sees the cache and the tree nodes whose bits are set in
    ``bits[j]`` -- its ancestors and itself -- with the bits of a one-token step that sees them
    (``decode_attention_tree`` in ``kernels/attention.h``)."""

    bits: torch.Tensor  # [n] int64


def supports_tree_rows(model: nn.Module) -> bool:
    """Whether ``model``'s forwards can verify :class:`TreeRows` in one ``llama_stack`` op: a
    Llama model on the fused ops with every linear on our int4 kernel."""
    return bool(getattr(model, "fused_ops", False)) and not model.cfg.is_gemma and int4_layers(model)


def tree_bits(mask: torch.Tensor) -> torch.Tensor:
    """A tree's ancestor mask [n, n] bool (row i sees node j) -> :class:`TreeRows`' bits [n] int64."""
    n = mask.shape[0]
    return (mask.to(torch.long) << torch.arange(n, device=mask.device)).sum(1)


@dataclass(frozen=True)
class GemmaNorms:
    """A Gemma-3 block's norm weights as its fused ops take them: 1 + w, float32 [D] ([Dh] for
    q and k), from the block's RMSNorm parameters (frozen targets: computed once)."""

    q: torch.Tensor
    k: torch.Tensor
    post_attn: torch.Tensor
    pre_ff: torch.Tensor
    post_ff: torch.Tensor
    input: torch.Tensor

    @classmethod
    def of(cls, block: nn.Module) -> GemmaNorms:
        def w(norm: nn.Module) -> torch.Tensor:
            return (norm.offset + norm.weight.detach().float()).contiguous()

        attn = block.self_attn
        return cls(
            w(attn.q_norm), w(attn.k_norm), w(block.post_attention_layernorm),
            w(block.pre_feedforward_layernorm), w(block.post_feedforward_layernorm), w(block.input_layernorm),
        )  # fmt: skip


def _gemma_blocks(cfg) -> bool:
    """Gemma-3's blocks as the fused ops know them: sandwich norms, q/k norms, GELU (tanh)."""
    return cfg.is_gemma and cfg.qk_norm and not cfg.attention_bias and cfg.hidden_act == "gelu_pytorch_tanh"


def supports_fused_ops(model: nn.Module) -> bool:
    """Llama-style blocks (plain RMSNorm, SiLU MLP, no q/k norm or biases, no sliding layers)
    or Gemma-3 blocks, whose q/k/v and gate/up are fused quantised matmuls with bf16
    activations."""
    cfg = model.cfg
    llama = not (cfg.qk_norm or cfg.attention_bias or cfg.hidden_act != "silu") and not any(
        cfg.is_sliding(i) for i in range(cfg.num_layers)
    )
    if not (_gemma_blocks(cfg) if cfg.is_gemma else llama):
        return False
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        fused = (attn.qkv, mlp.gate_up)
        single = (attn.o_proj, mlp.down_proj)
        if not all(isinstance(m, _BF16_INPUT) for m in fused):
            return False
        if not all(isinstance(m, QuantLinear) and isinstance(m.matmul, _BF16_INPUT) for m in single):
            return False
        # ``rows`` products: bias-free, and each single linear its matmul's whole output
        if any(m.bias is not None for m in (*fused, *(s.matmul for s in single))):
            return False
        if any(s.out_features != sum(s.matmul.sizes) for s in single):
            return False
    return True


def enable_fused_ops(model: nn.Module) -> bool:
    """Switch ``model`` onto the fused ops where it qualifies and they can be built (CPU);
    returns whether it now uses them. Call before recording steps (``StepGraph.reset``)."""
    from evospec.kernels.cpu_ops import load_cpu_ops

    device = next(model.parameters()).device
    model.fused_ops = device.type == "cpu" and supports_fused_ops(model) and load_cpu_ops()
    model.kv_dtype = torch.float16 if model.fused_ops else None  # the op's attention reads f16 K/V
    for block in model.layers:
        block.fused_norms = GemmaNorms.of(block) if model.fused_ops and model.cfg.is_gemma else None
    return model.fused_ops


def run_fused_layers(
    model: nn.Module,
    x: torch.Tensor,  # [B, n, D] f32
    ropes: tuple,  # (global, local) cos/sin tables for these positions
    cache,
    masks: dict[bool, torch.Tensor | None],  # by layer kind: sliding or not (Transformer's)
    rows: list | TreeRows | None,
    aux_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The blocks of ``model`` over x: (last block's output [B, n, D] f32, requested layers).
    :class:`TreeRows` (where :func:`supports_tree_rows`, no ``aux_layers``) go through one
    ``llama_stack`` op."""
    ops = torch.ops.evospec
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    layers = model.layers
    gemma = cfg.is_gemma
    b, n, dim = x.shape
    seen: dict[int, torch.Tensor] = {}
    # Activations stay flat rows [B * n, D] and the matmuls are called on them directly
    # (``rows``): the reshapes, casts and shape reads around each product were ~50 of a
    # layer's ~80 nodes in a recorded step, and a step replays every node.
    x = x.view(b * n, dim)  # f32 residual stream
    h = ops.rms_norm_bf16(x, input_norm(layers[0]), eps)  # [B n, D] bf16
    if isinstance(rows, TreeRows):
        if aux_layers or not supports_tree_rows(model):
            raise ValueError(
                "tree rows run as one llama_stack op: a Llama model on int4 kernels, no aux layers"
            )
        slots = _slot_tensor(cache, n)
        x, _ = _stack_op(model, x, h, (b, n), *ropes[False], cache, slots, eps, rows.bits)
        return x.view(b, n, dim), []
    one_op = _layer_op_applies(model, cache, masks[False], rows)
    slots = _slot_tensor(cache, n) if one_op else None  # [length + n]: where this forward writes
    if one_op and not gemma and not aux_layers:  # every layer in one op: one node, one team of threads
        x, _ = _stack_op(model, x, h, (b, n), *ropes[False], cache, slots, eps)
        return x.view(b, n, dim), []
    for i, block in enumerate(layers):
        nxt = input_norm(layers[i + 1]) if i + 1 < len(layers) else None  # None: the last
        sliding = cfg.is_sliding(i)
        cos, sin = cos_sin = ropes[sliding]
        if one_op:  # the same calls as the loop layer, as one node
            x, h = _layer_op(block, x, h, nxt, (b, n), cos, sin, cache, i, slots, eps)
        elif gemma:
            x, h = _gemma_loop_layer(block, x, h, nxt, (b, n), cos_sin, cache, masks, sliding, rows, eps)
        else:
            x, h = _loop_layer(block, x, h, nxt, (b, n), cos_sin, cache, masks[False], rows, eps)
        if i in aux_layers:
            seen[i] = x.view(b, n, dim)
    return x.view(b, n, dim), [seen[i] for i in aux_layers]


def input_norm(block: nn.Module) -> torch.Tensor:
    """The weight a block's input norm multiplies by (Gemma: 1 + w)."""
    return block.fused_norms.input if block.fused_norms is not None else block.input_layernorm.weight


def _layer_op(block, x, h, next_w, shape, cos, sin, cache, layer, slots, eps):
    """One layer as one ``llama_layer`` / ``gemma_layer`` op."""
    ops = torch.ops.evospec
    b, n = shape
    attn, mlp, w = block.self_attn, block.mlp, block.fused_norms
    mats = (attn.qkv.packed, attn.o_proj.matmul.packed, mlp.gate_up.packed, mlp.down_proj.matmul.packed)
    heads = (attn.num_heads, attn.num_kv_heads, attn.scale, eps)
    if w is None:
        return ops.llama_layer(
            x, h, *mats, block.post_attention_layernorm.weight, next_w, cos, sin, cache.k, cache.v,
            layer, slots, b, n, *heads,
        )  # fmt: skip
    return ops.gemma_layer(
        x, h, *mats, w.q, w.k, w.post_attn, w.pre_ff, w.post_ff, next_w, cos, sin, cache.k, cache.v,
        layer, slots, b, n, *heads, attn.window,
    )  # fmt: skip


def stack_weights(model: nn.Module) -> tuple[list[torch.Tensor], ...]:
    """What ``llama_stack`` and ``llama_stack_seqs`` take of a Llama model's layers: the packed
    qkv, o, gate_up and down products, the post-attention norms and the next layers' input norms."""
    layers = model.layers
    return (
        [blk.self_attn.qkv.packed for blk in layers],
        [blk.self_attn.o_proj.matmul.packed for blk in layers],
        [blk.mlp.gate_up.packed for blk in layers],
        [blk.mlp.down_proj.matmul.packed for blk in layers],
        [blk.post_attention_layernorm.weight for blk in layers],
        [input_norm(blk) for blk in layers[1:]],
    )


def _stack_op(model, x, h, shape, cos, sin, cache, slots, eps, tree=None):
    """Every Llama layer as one ``llama_stack`` op: layer i's output normed by layer i + 1's input
    norm, the last layer's x and post-attention h returned (what the layer ops chain gives);
    ``tree``: :class:`TreeRows`' bits."""
    b, n = shape
    attn = model.layers[0].self_attn
    return torch.ops.evospec.llama_stack(
        x, h, *stack_weights(model), cos, sin, cache.k, cache.v, slots, b, n,
        attn.num_heads, attn.num_kv_heads, attn.scale, eps, tree,
    )  # fmt: skip


def _loop_layer(block, x, h, next_w, shape, cos_sin, cache, mask, rows, eps):
    """One layer op by op: (x f32, h bf16) [B n, D] -> the same after it (h normed by
    ``next_w``; the last layer, without one, keeps the post-attention h)."""
    ops = torch.ops.evospec
    (b, n), (cos, sin) = shape, cos_sin
    attn, mlp = block.self_attn, block.mlp
    qkv = attn.qkv.rows(h).view(b, n, -1)
    q, k, v = ops.rope_qkv(qkv, cos, sin, attn.num_heads, attn.num_kv_heads)
    out = attn.attend_rotated(q, k, v, cache, mask, rows, fused=True)  # [B, H, n, Dh] f32
    out = out.transpose(1, 2).to(torch.bfloat16, memory_format=torch.contiguous_format)
    a = attn.o_proj.matmul.rows(out.view(b * n, -1))  # bf16
    x, h = ops.add_rms_norm_bf16(x, a, block.post_attention_layernorm.weight, eps)
    m = mlp.down_proj.matmul.rows(ops.silu_mul_bf16(mlp.gate_up.rows(h)))  # bf16
    if next_w is None:
        return x + m, h  # promotes to f32: the same sum add_rms_norm forms
    return ops.add_rms_norm_bf16(x, m, next_w, eps)


def _gemma_loop_layer(block, x, h, next_w, shape, cos_sin, cache, masks, sliding, rows, eps):
    """One Gemma-3 layer op by op (``gemma_layer``'s calls): (x f32, h bf16) [B n, D] -> the
    same after it. The attention op takes the full-attention mask and hides the keys past a
    sliding layer's window itself; SDPA's masked multi-row fallback takes the sliding mask."""
    ops = torch.ops.evospec
    (b, n), (cos, sin) = shape, cos_sin
    attn, mlp, w = block.self_attn, block.mlp, block.fused_norms
    qkv = attn.qkv.rows(h).view(b, n, -1)
    q, k, v = ops.rope_qkv_normed(qkv, cos, sin, attn.num_heads, attn.num_kv_heads, w.q, w.k, eps)
    out = attn.attend_rotated(q, k, v, cache, masks[False], rows, fused=True, sliding_mask=masks[sliding])
    out = out.transpose(1, 2).to(torch.bfloat16, memory_format=torch.contiguous_format)
    a = attn.o_proj.matmul.rows(out.view(b * n, -1))  # bf16
    x, h = ops.norm_add_rms_norm_bf16(x, a, w.post_attn, w.pre_ff, eps)
    m = mlp.down_proj.matmul.rows(ops.gelu_mul_bf16(mlp.gate_up.rows(h)))  # bf16
    x, h_next = ops.norm_add_rms_norm_bf16(x, m, w.post_ff, w.pre_ff if next_w is None else next_w, eps)
    return x, (h if next_w is None else h_next)


def _layer_op_applies(model: nn.Module, cache, mask, rows) -> bool:
    """Whether the layers can run as ``llama_layer`` / ``gemma_layer`` ops: a KV cache (or a
    recorded step's slot cache); one token, a prefill's causal rows or a row-exact chain (each
    row sees the cache and the rows before it: a prompt's rest after reused slots, a chain
    verified eagerly); every linear on our int4 kernel. Trees (eager rows: a recorded tree
    forward comes as :class:`TreeRows` instead), padded batches and other formats keep the loop."""
    if not isinstance(cache, (KVCache, SlotCache)):
        return False
    if rows is not None:  # row-exact rows: the loop attends by them and ignores the mask
        if not all(r.index is None and r.masks[False] is None for r in rows):
            return False  # a branching tree's rows
    elif mask is not None:
        return False
    return int4_layers(model)


def int4_layers(model: nn.Module) -> bool:
    """Whether every linear of ``model``'s layers runs our int4 kernel (what the one-op layers
    and ``llama_stack_seqs`` multiply with)."""
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        mats = (attn.qkv, attn.o_proj.matmul, mlp.gate_up, mlp.down_proj.matmul)
        if not all(isinstance(m, Int4Matmul) and m.kernel == "vnni" for m in mats):
            return False
    return True


def _slot_tensor(cache, n: int) -> torch.Tensor:
    """A tensor of the cache's length after this forward, the size the layer ops read (a
    recorded step's own, so that its graph keeps the length symbolic)."""
    if isinstance(cache, SlotCache):
        return cache.slots
    end = cache.length + n
    if end > cache.max_len:
        raise ValueError(f"KV cache overflow: need {end} slots, have {cache.max_len}")
    return torch.empty(end, dtype=torch.uint8)


def run_fused_draft_ids(
    head: nn.Module,
    features: torch.Tensor,
    tokens: torch.Tensor,
    first: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache,
) -> torch.Tensor:
    """features [n, D] float32 and tokens [n] at positions first, first + 1, ... -> the head's x
    [n, D] through ``draft_step_ids`` (the pairs and their RoPE rows taken in the op, from the
    target's embedding and ``rope``, cos / sin tables [L > first + n - 1, Dh]); writes the n
    pairs' K/V at the cache's next slots and advances it. Where :func:`draft_ids_apply`."""
    layer = head.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    end = cache.length + tokens.shape[0]
    if end > cache.max_len:
        raise ValueError(f"KV cache overflow: need {end} slots, have {cache.max_len}")
    table, scales = _embedding_table(head.embedding())
    x = torch.ops.evospec.draft_step_ids(
        features, tokens, table, rope[0], rope[1], first, head.fc.matmul.packed,
        head.fc.matmul.bias, attn.qkv.packed, attn.o_proj.matmul.packed, mlp.gate_up.packed,
        mlp.down_proj.matmul.packed, layer.post_attention_layernorm.weight, cache.k, cache.v, end,
        attn.num_heads, attn.num_kv_heads, attn.scale, head.cfg.rms_norm_eps, scales,
    )  # fmt: skip
    cache.advance(tokens.shape[0])
    return x


def draft_ids_apply(head: nn.Module) -> bool:
    """Whether :func:`run_fused_draft_ids` serves ``head``: a fused step (:func:`enable_fused_draft`)
    over a float32 embedding table or a compact one (``embedding.py``)."""
    if not getattr(head, "fused_step", False):
        return False
    table, _ = _embedding_table(head.embedding())
    return table.dtype in (torch.float32, torch.int8) and table.is_contiguous()


def _embedding_table(emb: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``draft_step_ids`` reads of an embedding: (float32 table, None), or a compact one's
    (int8 codes, float16 scales) -- never its float table, which would be built for it."""
    if isinstance(emb, CompactEmbedding):
        return emb.codes, emb.scales
    return emb.weight, None


def fused_draft_applies(head: nn.Module) -> bool:
    """An EAGLE-2 head whose step the ``draft_step`` op can run once its linears are int4: one
    plain Llama layer (SiLU, no q/k norm or attention bias), heads a multiple of 16 wide, on the
    CPU with the op library built and its int4 linears on our int8-activation kernel (AVX2 or
    later; not under ``EVOSPEC_QUANT_KERNEL=torch``: ``auto`` then drafts with the int8 copy)."""
    from evospec.kernels.cpu_ops import load_cpu_ops

    cfg = getattr(head, "cfg", None)
    if getattr(head, "arch", None) != "eagle2" or cfg is None:
        return False
    plain = cfg.hidden_act == "silu" and not cfg.qk_norm and not cfg.attention_bias and cfg.head_dim % 16 == 0
    device = next(p for n, p in head.named_parameters() if "norm" in n).device
    if not (plain and device.type == "cpu" and load_cpu_ops()):
        return False
    return quant_kernel(cfg.hidden_size) == "vnni"  # our int4 kernel (this CPU, EVOSPEC_QUANT_KERNEL)


def enable_fused_draft(head: nn.Module) -> bool:
    """Run ``head``'s chain steps (one row, or causal rows behind its cache) as one ``draft_step``
    op where it qualifies and every linear is on our int4 kernel (``quantised_head(head, "int4")``
    on a VNNI build); returns whether it now does. Its numbers are the op's (int4 products, bf16
    activation codes, ``decode_attention``), not the eager layer's: a draft's numbers decide what
    is proposed, never what is emitted."""
    layer = getattr(head, "layers", [None])[0]
    ok = fused_draft_applies(head) and layer is not None
    if ok:
        attn, mlp = layer.self_attn, layer.mlp
        mats = (head.fc.matmul, attn.qkv, attn.o_proj.matmul, mlp.gate_up, mlp.down_proj.matmul)
        ok = all(isinstance(m, Int4Matmul) and m.kernel == "vnni" for m in mats)
        ok = ok and all(m.bias is None for m in mats[1:])  # the op adds fc's bias only
    head.fused_step = ok
    return ok


def run_fused_draft(head: nn.Module, pairs: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """pairs [B, n, 2 D] ([embedding, feature]) -> the head's x [B, n, D] through ``draft_step``;
    writes the n pairs' K/V at the cache's next slots (row j attends to the cache and rows 0..j)."""
    b, n, _ = pairs.shape
    layer = head.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    cos, sin = head.rope(positions, pairs.dtype)
    x = torch.ops.evospec.draft_step(
        pairs.reshape(b * n, -1).contiguous(), head.fc.matmul.packed, head.fc.matmul.bias,
        attn.qkv.packed, attn.o_proj.matmul.packed, mlp.gate_up.packed, mlp.down_proj.matmul.packed,
        layer.post_attention_layernorm.weight, cos, sin, cache.k, cache.v, _slot_tensor(cache, n),
        b, n, attn.num_heads, attn.num_kv_heads, attn.scale, head.cfg.rms_norm_eps,
    )  # fmt: skip
    return x.view(b, n, -1)

"""One new token for each of several sequences in one forward: plain decoding of concurrent
requests, each row bitwise the one-token step that sequence would take alone.

Owns: :func:`batched_steps_apply` (which models can) and :func:`step_sequences` (the forward).
Each sequence keeps its own :class:`~evospec.models.kv_cache.KVCache` (batch 1, any length and
size: the cache a decoder prefilled for it); the ``llama_stack_seqs`` op runs every layer for all
rows with one team of threads (``kernels/llama_layer.cpp``): the int4 products read each weight
once for the B rows, and each sequence's RoPE row, K/V write and attention are those of its own
step at its own length. On a memory-bound CPU an extra row costs a fraction of a step (the
products' arithmetic), so B sequences advance for much less than B steps.

Why the rows are exact: the products, norms and elementwise steps compute each row with the same
code whatever the number of rows (as chain verification relies on); the attention of sequence i
runs on the plan a one-sequence step at its length makes. The final norm and the LM head are the
model's own calls on [B, 1, D] (row-exact too; ``tests/models/test_batch_step.py`` checks logits
bit for bit against one-token steps). Scope: Llama-style models on the fused CPU ops with every
linear on our int4 kernel (SmolLM2, the default); elsewhere ``batched_steps_apply`` is False and
callers step one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from evospec.models.fused import input_norm, int4_layers, stack_weights
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer

AUTO_BATCH = "auto"  # a batch size: as many sequences as one pass of the kernels over a weight takes


def batch_size(max_batch: int | str) -> int:
    """``max_batch`` as a number of sequences: :data:`AUTO_BATCH` is the rows our int4 kernel
    takes in one pass over each weight tile (``kernels/int4_matmul.py: block_rows``; 8 on
    AVX-512, 4 elsewhere) -- on a memory-bound CPU, rows up to it cost a fraction of a step each,
    past it a second pass over every tile. ValueError for anything else but an integer >= 1."""
    if max_batch == AUTO_BATCH:
        from evospec.kernels.int4_matmul import block_rows

        return block_rows()
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an integer >= 1 or {AUTO_BATCH!r}, got {max_batch!r}")
    return max_batch


def batched_steps_apply(model: Transformer) -> bool:
    """Whether :func:`step_sequences` serves ``model``: a Llama-style model on the fused CPU ops
    whose linears all run our int4 kernel (what a one-token step runs as one ``llama_stack``)."""
    return bool(getattr(model, "fused_ops", False)) and not model.cfg.is_gemma and int4_layers(model)


def _stack_weights(model: Transformer) -> tuple[list[torch.Tensor], ...]:
    """``stack_weights(model)``, gathered once and kept on the model (~180 attribute reads a
    step otherwise); gathered again if its first product was replaced (requantised)."""
    cached = getattr(model, "_stack_seqs_weights", None)
    if cached is None or cached[0][0] is not model.layers[0].self_attn.qkv.packed:
        cached = model._stack_seqs_weights = stack_weights(model)
    return cached


@torch.inference_mode()
def step_sequences(model: Transformer, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
    """Append ``tokens[i]`` to ``caches[i]`` at its next slot (advancing it by one) and return
    the logits [B, V] of the B new positions; row i is bitwise what ``model(tokens[i], ...)``
    on ``caches[i]`` alone returns. Every cache must hold one sequence (batch 1) with room for
    one more slot; the caches are distinct."""
    b = len(tokens)
    if b < 1 or len(caches) != b:
        raise ValueError(f"one cache per token: {b} tokens, {len(caches)} caches")
    if len({id(c) for c in caches}) != b:
        raise ValueError("a cache appears twice")
    for c in caches:
        if c.batch != 1 or c.length >= c.max_len:
            have = f"a cache of batch {c.batch} with {c.length}/{c.max_len} slots"
            raise ValueError(f"{have} cannot take a token")
    cfg, layers = model.cfg, model.layers
    device = model.device
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)  # [B]
    positions = torch.tensor([c.length for c in caches], device=device)  # [B]
    x = model.embed_tokens(ids)  # [B, D] f32 (Llama: no embedding scale)
    h = torch.ops.evospec.rms_norm_bf16(x, input_norm(layers[0]), cfg.rms_norm_eps)  # [B, D] bf16
    cos, sin = model.rope_global(positions, x.dtype)  # [B, Dh] each: row i at sequence i's position
    attn = layers[0].self_attn
    x, _ = torch.ops.evospec.llama_stack_seqs(
        x, h, *_stack_weights(model), cos.contiguous(), sin.contiguous(), [c.k for c in caches],
        [c.v for c in caches], [c.length + 1 for c in caches], attn.num_heads, attn.num_kv_heads, attn.scale,
        cfg.rms_norm_eps,
    )  # fmt: skip
    for c in caches:
        c.advance(1)
    hidden = model.norm(x.view(b, 1, -1))  # [B, 1, D]
    return model.project_logits(hidden)[:, 0]  # [B, V]

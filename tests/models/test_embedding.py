"""The token embedding kept as int8 codes and float16 scales: found only where it is exact, the
same rows bit for bit (torch path, op, draft op), the float table built only when asked for."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.embedding import (
    GROUP,
    CompactEmbedding,
    compact_embedding,
    compact_rows,
    embed_rows_ref,
)
from evospec.models.quant import quantize_linears
from tests.decoding.spec_helpers import tiny_target


def q8_table(vocab: int, dim: int, seed: int = 0) -> torch.Tensor:
    """float32 [vocab, dim] holding a Q8_0 table's values: float16 scale x int8 code per 32."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (vocab, dim // GROUP, GROUP), generator=g).float()
    codes[:, :, 0] = 127 * torch.sign(torch.randn(vocab, dim // GROUP, generator=g))  # Q8_0: a +-127 a block
    scales = (torch.rand(vocab, dim // GROUP, 1, generator=g) * 0.01).half().float()
    return (codes * scales).view(vocab, dim)


def test_a_q8_table_is_found_exactly_and_others_are_left_alone():
    table = q8_table(300, 64)
    table[7, :GROUP] = 0.0  # an all-zero block
    pair = compact_rows(table)
    assert pair is not None
    codes, scales = pair
    assert codes.dtype == torch.int8 and codes.shape == (300, 64)
    assert scales.dtype == torch.float16 and scales.shape == (300, 2)
    ids = torch.arange(300)
    assert torch.equal(embed_rows_ref(codes, scales, ids).view(torch.int32), table.view(torch.int32))
    assert compact_rows(torch.randn(300, 64)) is None  # a float table: no such form
    signed_zero = table.clone()
    signed_zero[7, 3] = -0.0  # the products would give +0.0: not bit for bit
    assert compact_rows(signed_zero) is None
    assert compact_rows(q8_table(10, 64)[:, :48].contiguous()) is None  # 48 columns: not whole groups
    assert compact_rows(table.bfloat16()) is None


def test_the_module_gives_nn_embeddings_rows_and_builds_the_table_only_when_asked():
    table = q8_table(200, 96, seed=1)
    dense = nn.Embedding.from_pretrained(table)
    emb = CompactEmbedding(*compact_rows(table))
    ids = torch.tensor([[3, 199, 0], [5, 5, 42]])
    assert torch.equal(emb(ids), dense(ids))  # the op where the library is built, else torch ops
    assert torch.equal(embed_rows_ref(emb.codes, emb.scales, ids), dense(ids))
    assert emb.nbytes < table.nbytes / 3
    assert "weight" not in dir(emb)  # the tracer reads what dir() names
    assert emb.materialised == 0
    w = emb.weight
    assert torch.equal(w, table) and emb.materialised == 1
    assert emb.weight is w and emb.materialised == 1  # kept while a caller holds it
    del w
    gc.collect()
    assert torch.equal(emb.weight, table) and emb.materialised == 2  # built again, not kept


def test_the_op_checks_what_it_reads():
    if not load_cpu_ops():
        pytest.skip("the CPU op library is not built here")
    codes, scales = compact_rows(q8_table(10, 64))
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        torch.ops.evospec.embed_rows(codes, scales, torch.tensor([10]))
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.evospec.embed_rows(codes, scales.float(), torch.tensor([1]))


def _q8_model(fmt: str = "int4", seed: int = 0, tied: bool = True):
    """A tiny model whose embedding holds a Q8_0 table's values (tied to its LM head), quantised."""
    model = tiny_target(seed, head_dim=16)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(q8_table(*model.embed_tokens.weight.shape, seed=seed))
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    quantize_linears(model, fmt)
    return model


def _prefill_logits(model, ids):
    cache = model.new_cache(len(ids) + 1)
    return model(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="all").logits


def test_a_quantised_models_logits_do_not_change():
    load_cpu_ops()  # the embedding's op where it can be built (else its torch ops)
    model = _q8_model()
    assert model.lm_head.weight is model.embed_tokens.weight
    table = model.embed_tokens.weight.detach().clone()
    ids = [1, 5, 9, 2, 7, 7, 3]
    with torch.inference_mode():
        before = _prefill_logits(model, ids)
    freed = compact_embedding(model)
    assert isinstance(model.embed_tokens, CompactEmbedding) and freed > 0
    with torch.inference_mode():
        assert torch.equal(_prefill_logits(model, ids), before)
    assert torch.equal(model.lm_head.weight, table)  # a tied head still answers with the floats
    assert "weight" not in dir(model.lm_head)


def test_models_whose_head_reads_the_floats_or_whose_table_is_not_exact_keep_nn_embedding():
    dense_head = tiny_target(0, head_dim=16)
    with torch.no_grad():
        dense_head.embed_tokens.weight.copy_(q8_table(*dense_head.embed_tokens.weight.shape))
    dense_head.lm_head.weight = dense_head.embed_tokens.weight
    assert compact_embedding(dense_head) == 0  # its fp32 LM head is that table
    untied = _q8_model(tied=False)  # its quantised head keeps its own floats: the table goes
    assert compact_embedding(untied) > 0 and untied.lm_head.weight is not None
    floats = tiny_target(0, head_dim=16)
    quantize_linears(floats, "int4")
    assert compact_embedding(floats) == 0 and isinstance(floats.embed_tokens, nn.Embedding)


def test_the_fused_draft_step_reads_a_compact_embedding_bit_for_bit():
    from evospec.models.eagle import new_eagle_for, quantised_head
    from evospec.models.fused import (
        draft_ids_apply,
        enable_fused_draft,
        enable_fused_ops,
        run_fused_draft_ids,
    )

    dense = _q8_model(seed=2)
    compact = _q8_model(seed=2)
    assert compact_embedding(compact) > 0
    for m in (dense, compact):
        m.exact_rows = True
        enable_fused_ops(m)
    if compact.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the fused draft step needs our int4 kernel")
    heads = [quantised_head(new_eagle_for(m, seed=3), "int4").attach(m) for m in (dense, compact)]
    assert all(enable_fused_draft(h) and draft_ids_apply(h) for h in heads)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(5, dense.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, dense.cfg.vocab_size, (5,), generator=g)
    rope = heads[0].rope(torch.arange(16), torch.float32)
    outs = []
    with torch.inference_mode():
        for h in heads:
            outs.append(run_fused_draft_ids(h, feats, tokens, 0, rope, h.new_cache(8)))
    assert torch.equal(outs[0], outs[1])
    assert compact.embed_tokens.materialised == 0


def test_speculative_decoding_on_a_compact_embedding_equals_ar():
    """Lossless where the table is compact: the int4 fused draft reading the codes, the vocabulary
    head taking the int8 head's shape only, the recorded steps embedding through the op -- eagle2
    gives AR's greedy tokens, and AR those of the same model with its float table."""
    from evospec.decoding.methods import make_decoder
    from evospec.decoding.sampling import SamplingParams
    from evospec.decoding.tree import TreeConfig
    from evospec.models.eagle import new_eagle_for
    from evospec.models.fused import enable_fused_ops
    from evospec.models.step import StepGraph

    models = []
    for compact in (False, True):
        m = _q8_model(seed=4)
        if compact:
            assert compact_embedding(m) > 0
        m.exact_rows = True
        if not enable_fused_ops(m):
            pytest.skip("the fused CPU ops do not build here")
        m.step_graph = StepGraph(m)
        models.append(m)
    dense, compact = models
    params = SamplingParams(max_new_tokens=24)
    tree = TreeConfig(top_k=1, depth=3, total_tokens=3)
    for seed in range(3):
        prompt = torch.randint(0, 64, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        outs = {}
        for name, m in (("dense", dense), ("compact", compact)):
            for method in ("ar", "eagle2"):
                draft = new_eagle_for(m, seed=seed) if method == "eagle2" else None
                dec = make_decoder(method, m, draft=draft, tree=tree)
                with torch.inference_mode():
                    outs[name, method] = [t for ev in dec.generate(prompt, params) for t in ev.tokens]
        assert outs["compact", "eagle2"] == outs["compact", "ar"] == outs["dense", "ar"]
    assert compact.embed_tokens.materialised == 0

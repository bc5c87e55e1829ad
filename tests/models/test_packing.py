"""Prepacked (oneDNN) linears: same results as dense, names and ties kept, never stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evospec.models.packing import PackedLinear, PackedMatmul, pack_linears, packing_available, unpack_linears
from tests.conftest import FAMILIES, full_forward, random_tokens, tiny_models

pytestmark = pytest.mark.skipif(not packing_available(torch.zeros(2, 2)), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_matmul_equals_dense(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(2, rows, 40, generator=g)
    got = PackedMatmul([w], [b])(x)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_repacks_after_in_place_update() -> None:
    w = torch.randn(8, 4)
    mm = PackedMatmul([w])
    x = torch.randn(1, 4)
    before = mm(x)
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(mm(x), 2.0 * before, atol=1e-5, rtol=1e-5)


def test_autograd_falls_back_to_dense() -> None:
    w = torch.randn(8, 4)
    x = torch.randn(3, 4, requires_grad=True)
    PackedMatmul([w])(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 4))


def test_rejects_unpackable_weight() -> None:
    with pytest.raises(ValueError, match="cannot pack"):
        PackedMatmul([torch.randn(4, 4, dtype=torch.float64)])
    with pytest.raises(ValueError, match="cannot pack"):
        PackedMatmul([torch.randn(4, 4), torch.randn(4, 5)])  # inputs differ
    with pytest.raises(ValueError, match="every fused weight has a bias or none"):
        PackedMatmul([torch.randn(4, 4), torch.randn(2, 4)], [torch.randn(4), None])


def test_fused_weights_equal_separate_and_follow_updates() -> None:
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 24, generator=g) for n in (16, 8, 8)]
    bs = [torch.randn(n, generator=g) for n in (16, 8, 8)]
    x = torch.randn(1, 5, 24, generator=g)
    fused = PackedMatmul(ws, bs)
    assert fused.sizes == [16, 8, 8]
    parts = fused(x).split(fused.sizes, dim=-1)
    for part, w, b in zip(parts, ws, bs, strict=True):
        torch.testing.assert_close(part, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        bs[2].add_(1.0)  # any one source changing repacks
    torch.testing.assert_close(fused(x)[..., 24:], parts[2] + 1.0, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_model_matches_dense_and_keeps_names(family: str) -> None:
    model = tiny_models(family, seed=5).ours
    tokens = random_tokens(12, seed=2)
    names = list(model.state_dict())
    dense = full_forward(model, tokens)
    n = pack_linears(model)
    assert n == sum(1 for m in model.modules() if isinstance(m, PackedLinear))
    assert n >= 7 * model.cfg.num_layers  # q k v o gate up down per layer, plus the LM head
    assert pack_linears(model) == 0  # idempotent
    for layer in model.layers:
        assert layer.self_attn.qkv is not None and layer.mlp.gate_up is not None
    assert list(model.state_dict()) == names
    if model.cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(full_forward(model, tokens), dense, atol=1e-4, rtol=1e-4)
    assert unpack_linears(model) == n
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert model.layers[0].self_attn.qkv is None and model.layers[0].mlp.gate_up is None
    assert isinstance(model.layers[0].mlp.up_proj, nn.Linear)
    torch.testing.assert_close(full_forward(model, tokens), dense, atol=0, rtol=0)


def test_packed_rows_follow_touched_and_untouched_writes():
    from evospec.models.packing import PackedRows

    torch.manual_seed(0)
    rows, x = torch.randn(20, 16), torch.randn(3, 16)
    packed = PackedRows(rows, block=8)  # blocks [0, 8), [8, 16), [16, 20)
    assert torch.allclose(packed(x), x @ rows.T, atol=1e-5) and packed.repacked_blocks == 3
    rows[9] = torch.randn(16)
    packed.touch(torch.tensor([9]))
    assert torch.allclose(packed(x), x @ rows.T, atol=1e-5) and packed.repacked_blocks == 4  # one block
    rows[2] += 1.0  # a write the owner did not report: caught by the version counter
    assert torch.allclose(packed(x), x @ rows.T, atol=1e-5) and packed.repacked_blocks == 7
    grad_rows = rows.clone().requires_grad_(True)
    out = PackedRows(grad_rows, block=8)(x)  # autograd: the dense product, with a graph
    assert out.requires_grad

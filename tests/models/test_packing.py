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
    got = PackedMatmul(w, b)(x)
    assert got.shape == (2, rows, 96)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_repacks_after_in_place_update() -> None:
    w = torch.randn(8, 4)
    mm = PackedMatmul(w)
    x = torch.randn(1, 4)
    before = mm(x)
    with torch.no_grad():
        w.mul_(2.0)
    torch.testing.assert_close(mm(x), 2.0 * before, atol=1e-5, rtol=1e-5)


def test_autograd_falls_back_to_dense() -> None:
    w = torch.randn(8, 4)
    x = torch.randn(3, 4, requires_grad=True)
    PackedMatmul(w)(x).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 4))


def test_rejects_unpackable_weight() -> None:
    with pytest.raises(ValueError, match="cannot pack"):
        PackedMatmul(torch.randn(4, 4, dtype=torch.float64))


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
    assert list(model.state_dict()) == names
    if model.cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    torch.testing.assert_close(full_forward(model, tokens), dense, atol=1e-4, rtol=1e-4)
    assert unpack_linears(model) == n
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert isinstance(model.layers[0].mlp.up_proj, nn.Linear)
    torch.testing.assert_close(full_forward(model, tokens), dense, atol=0, rtol=0)

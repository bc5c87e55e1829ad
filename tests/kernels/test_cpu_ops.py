"""The fused CPU ops: their torch references' numbers, row-exact, and clear errors."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels import cpu_ops
from evospec.kernels.cpu_ops import (
    add_rms_norm_bf16_ref,
    decode_attention_ref,
    rms_norm_bf16_ref,
    rope_qkv_ref,
    silu_mul_bf16_ref,
)

pytestmark = pytest.mark.skipif(not cpu_ops.load_cpu_ops(), reason="no C++ compiler for the fused CPU ops")
OPS = torch.ops.evospec if cpu_ops.load_cpu_ops() else None


def _close_bf16(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to one bf16 rounding step (2^-8 relative)."""
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("d", [8, 37, 576])
def test_rms_norm_matches_the_reference_and_is_row_exact(d):
    g = torch.Generator().manual_seed(d)
    x = torch.randn(5, 3, d, generator=g) * 4
    w = torch.rand(d, generator=g) + 0.5
    out = OPS.rms_norm_bf16(x, w, 1e-5)
    _close_bf16(out, rms_norm_bf16_ref(x, w, 1e-5))
    assert torch.equal(out[2, 1], OPS.rms_norm_bf16(x[2, 1:2], w, 1e-5)[0])  # a row alone: same bits


def test_add_rms_norm_adds_exactly_and_norms_the_sum():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g)
    for y in (torch.randn(4, 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g)):
        s, h = OPS.add_rms_norm_bf16(x, y, torch.ones(64), 1e-6)
        s_ref, h_ref = add_rms_norm_bf16_ref(x, y, torch.ones(64), 1e-6)
        assert torch.equal(s, s_ref)  # the residual stream is the plain f32 sum
        _close_bf16(h, h_ref)


@pytest.mark.parametrize("batch,per_row", [(1, False), (3, False), (3, True)])
def test_rope_qkv_matches_the_reference(batch, per_row):
    g = torch.Generator().manual_seed(batch)
    hq, hk, dh, n = 4, 2, 16, 5
    qkv = torch.randn(batch, n, (hq + 2 * hk) * dh, generator=g).bfloat16()
    shape = (batch, 1, n, dh) if per_row else (n, dh)
    cos, sin = torch.rand(*shape, generator=g), torch.rand(*shape, generator=g)
    got = OPS.rope_qkv(qkv, cos, sin, hq, hk)
    want = rope_qkv_ref(qkv, cos, sin, hq, hk)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    one = OPS.rope_qkv(
        qkv[:1, 2:3],
        cos[2:3] if not per_row else cos[:1, :, 2:3],
        *((sin[2:3],) if not per_row else (sin[:1, :, 2:3],)),
        hq,
        hk,
    )
    assert torch.equal(one[0][0, :, 0], got[0][0, :, 2])  # a row alone: same bits


def test_silu_mul_matches_the_reference_over_a_wide_range():
    g = torch.Generator().manual_seed(3)
    gate = torch.linspace(-90, 90, 1536)[None].repeat(2, 1)
    gu = torch.cat([gate, torch.randn(2, 1536, generator=g) * 3], dim=-1).bfloat16()
    out = OPS.silu_mul_bf16(gu)
    _close_bf16(out, silu_mul_bf16_ref(gu))
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out[1], OPS.silu_mul_bf16(gu[1:2])[0])


@pytest.mark.parametrize("batch,masked", [(1, False), (1, True), (2, True)])
def test_decode_attention_matches_sdpa_on_cache_views(batch, masked):
    g = torch.Generator().manual_seed(batch + 2 * masked)
    cache = torch.randn(batch, 2, 40, 16, generator=g)  # [B, H_kv, S_max, Dh]
    s = 23
    keys, values = cache[:, :, :s], cache[:, :, :s].flip(-1).contiguous()
    q = torch.randn(batch, 4, 1, 16, generator=g)
    mask = None
    if masked:
        mask = torch.rand(batch, 1, 1, s, generator=g) > 0.4
        mask[..., 0] = True
    got = OPS.decode_attention(q, keys, values, mask, 0.25)
    torch.testing.assert_close(got, decode_attention_ref(q, keys, values, mask, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pads", [(0, 5), (9, 1), (22, 3)])
def test_a_left_padded_row_gives_the_bits_of_the_row_without_padding(pads):
    """Batched generation right-aligns rows: row b's first pads[b] slots are masked. The kernel
    starts each row at its first visible key; a masked slot after it still counts as masked."""
    g = torch.Generator().manual_seed(sum(pads))
    b, s, dh = len(pads), 23, 64
    keys, values = torch.randn(b, 3, s, dh, generator=g), torch.randn(b, 3, s, dh, generator=g)
    q = torch.randn(b, 9, 1, dh, generator=g)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    for i, p in enumerate(pads):
        mask[i, ..., :p] = False
    mask[1, ..., s - 2] = False  # a hole after the padding
    got = OPS.decode_attention(q, keys, values, mask, 0.125)
    for i, p in enumerate(pads):
        alone = OPS.decode_attention(
            q[i : i + 1], keys[i : i + 1, :, p:], values[i : i + 1, :, p:], mask[i : i + 1, ..., p:], 0.125
        )
        assert torch.equal(got[i], alone[0])
    torch.testing.assert_close(got, decode_attention_ref(q, keys, values, mask, 0.125), rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(RuntimeError, match="float32"):
        OPS.rms_norm_bf16(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="w must be"):
        OPS.rms_norm_bf16(torch.zeros(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="width"):
        OPS.rope_qkv(torch.zeros(1, 2, 30, dtype=torch.bfloat16), torch.ones(2, 4), torch.ones(2, 4), 2, 1)
    with pytest.raises(RuntimeError, match="mask"):
        q, k = torch.zeros(1, 2, 1, 4), torch.zeros(1, 1, 3, 4)
        OPS.decode_attention(q, k, k, torch.ones(5, dtype=torch.bool), 1.0)


def test_the_library_is_built_once_per_machine_and_can_be_turned_off(monkeypatch):
    key = cpu_ops.build_key()
    assert len(key) == 16 and key == cpu_ops.build_key()
    cpu_ops.load_cpu_ops.cache_clear()
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    try:
        assert cpu_ops.load_cpu_ops() is False
    finally:
        cpu_ops.load_cpu_ops.cache_clear()
        monkeypatch.delenv(cpu_ops.DISABLE_ENV)
        assert cpu_ops.load_cpu_ops()


def test_decode_attention_of_a_chain_gives_each_row_its_one_row_bits():
    """Row j of n sees the first S - n + 1 + j keys: a chain verified after the cache."""
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(1, 2, 30, 16, generator=g)
    s, n = 19, 4
    keys, values = cache[:, :, :s], cache[:, :, 5 : 5 + s]
    q = torch.randn(1, 4, n, 16, generator=g)
    got = OPS.decode_attention(q, keys, values, None, 0.3)
    torch.testing.assert_close(got, decode_attention_ref(q, keys, values, None, 0.3), rtol=1e-5, atol=1e-6)
    for j in range(n):
        end = s - n + 1 + j
        alone = OPS.decode_attention(q[:, :, j : j + 1], keys[:, :, :end], values[:, :, :end], None, 0.3)
        assert torch.equal(alone[:, :, 0], got[:, :, j])
    with pytest.raises(RuntimeError, match="one query row"):
        OPS.decode_attention(q, keys, values, torch.ones(s, dtype=torch.bool), 0.3)


@pytest.mark.parametrize("prefix", [3, 14, 16, 40])
@pytest.mark.parametrize("half", [False, True])
def test_decode_attention_of_a_tree_gives_each_row_the_bits_of_a_step_over_its_ancestors(prefix, half):
    """A draft tree's rows (``tree``: the nodes each row sees) over the last n keys: each row gets
    the bits of a one-row call whose keys are the prefix, then its ancestors and itself laid out
    behind it -- also where the tree straddles a block of 16 keys and hidden siblings sit between
    the keys a row sees (its total summed as that step lays them out)."""
    g = torch.Generator().manual_seed(prefix)
    parents = [-1, 0, 0, 0, 1, 2, 4, 4, 3, 7]  # a fan of 3, and chains under it
    n = len(parents)
    keys = torch.randn(1, 3, prefix + n, 64, generator=g)
    values = torch.randn(1, 3, prefix + n, 64, generator=g)
    keys, values = (keys.half(), values.half()) if half else (keys, values)
    q = torch.randn(1, 9, n, 64, generator=g) * 3  # sharp scores: totals that depend on the order
    seen = []
    for j, par in enumerate(parents):
        nodes = [j]
        while par >= 0:
            nodes.insert(0, par)
            par = parents[par]
        seen.append(nodes)
    bits = torch.tensor([sum(1 << i for i in nodes) for nodes in seen])
    got = OPS.decode_attention(q, keys, values, None, 0.125, 0, bits)
    for j, nodes in enumerate(seen):
        order = list(range(prefix)) + [prefix + i for i in nodes]
        alone = OPS.decode_attention(q[:, :, j : j + 1], keys[:, :, order], values[:, :, order], None, 0.125)
        assert torch.equal(alone[:, :, 0], got[:, :, j]), j
    with pytest.raises(RuntimeError, match="no later row"):
        OPS.decode_attention(q, keys, values, None, 0.125, 0, bits.flip(0))
    with pytest.raises(RuntimeError, match="int64"):
        OPS.decode_attention(q, keys, values, None, 0.125, 0, bits.int())
    wide = torch.randn(1, 3, 65, 64, generator=g)
    with pytest.raises(RuntimeError, match="n <= 64"):  # a row's bit set holds 64 nodes
        OPS.decode_attention(
            torch.randn(1, 9, 65, 64), wide, wide, None, 0.125, 0, torch.ones(65, dtype=torch.long)
        )


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_every_row_grouping_of_an_f16_chain_gives_each_row_its_one_row_bits(n):
    """The model's shape (9 query heads over 3 KV heads of 64, f16 cache) over more keys than one
    values chunk: 3n rows per KV head are split into blocks, pairs and lone rows however the
    build blocks them (the ymm build converts a shared chunk's values once), and each row still
    gets the bits of its one-row call over the keys it sees."""
    g = torch.Generator().manual_seed(n)
    s = 150
    keys = torch.randn(1, 3, s, 64, generator=g).half()
    values = torch.randn(1, 3, s, 64, generator=g).half()
    q = torch.randn(1, 9, n, 64, generator=g)
    got = OPS.decode_attention(q, keys, values, None, 0.125)
    torch.testing.assert_close(
        got, decode_attention_ref(q, keys.float(), values.float(), None, 0.125), rtol=1e-5, atol=1e-6
    )
    for j in range(n):
        end = s - n + 1 + j
        for head in (0, 4, 8):  # one of each KV head's group, first / middle / last
            kv = slice(head // 3, head // 3 + 1)
            row = q[:, head : head + 1, j : j + 1]
            alone = OPS.decode_attention(row, keys[:, kv, :end], values[:, kv, :end], None, 0.125)
            assert torch.equal(alone[:, 0, 0], got[:, head, j])


def test_decode_attention_reads_an_f16_cache_as_its_exact_f32_values():
    """float16 -> float32 is exact, so an f16 cache gives the bits of the same values in f32,
    whether its keys are converted once for a block of rows or as each row loads them."""
    g = torch.Generator().manual_seed(11)
    s, n = 45, 3
    keys = torch.randn(1, 3, s, 64, generator=g).half()
    values = torch.randn(1, 3, s, 64, generator=g).half()
    for heads, rows in ((9, 1), (9, n), (3, 1)):  # 3 / 9 / 1 rows share each KV head
        q = torch.randn(1, heads, rows, 64, generator=g)
        got = OPS.decode_attention(q, keys, values, None, 0.125)
        assert torch.equal(got, OPS.decode_attention(q, keys.float(), values.float(), None, 0.125))
        torch.testing.assert_close(
            got, decode_attention_ref(q, keys.float(), values.float(), None, 0.125), rtol=1e-5, atol=1e-6
        )
    with pytest.raises(RuntimeError, match="float16"):
        OPS.decode_attention(q, keys, values.float(), None, 0.125)


@pytest.mark.parametrize("dh", [24, 64, 128])
def test_a_row_of_a_grouped_head_gives_the_bits_of_that_head_alone(dh):
    """Query heads that share a KV head are computed together (each key loaded once for all of
    them): a head's rows still get the bits of a call with that head alone, at every length
    (heads that are not a multiple of 16 are padded)."""
    g = torch.Generator().manual_seed(dh)
    s, n = 37, 2
    keys, values = torch.randn(1, 2, s, dh, generator=g), torch.randn(1, 2, s, dh, generator=g)
    q = torch.randn(1, 6, n, dh, generator=g)
    got = OPS.decode_attention(q, keys, values, None, 0.2)
    torch.testing.assert_close(got, decode_attention_ref(q, keys, values, None, 0.2), rtol=1e-5, atol=1e-6)
    for head in range(6):
        kv = head // 3
        one_kv = (keys[:, kv : kv + 1], values[:, kv : kv + 1])
        alone = OPS.decode_attention(q[:, head : head + 1], *one_kv, None, 0.2)
        assert torch.equal(alone[:, 0], got[:, head])

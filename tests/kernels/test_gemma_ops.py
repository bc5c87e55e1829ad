"""Gemma-3's fused CPU ops: windowed attention, q/k-normed RoPE, norm-then-add, GELU gating."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.cpu_ops import (
    decode_attention_ref,
    gelu_mul_bf16_ref,
    norm_add_rms_norm_bf16_ref,
    rope_qkv_normed_ref,
)
from tests.kernels.test_cpu_ops import OPS, _close_bf16, pytestmark  # noqa: F401 (pytestmark: the same skip)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 7, 20, 33, 200])
def test_windowed_attention_matches_the_reference_and_each_row_keeps_its_lone_bits(window, kv_dtype):
    """A sliding layer's rows see at most ``window`` keys, ending at their own: a chain (or a
    prefill's rows) computed in one call gives each row the bits of that row alone, whose
    window starts elsewhere in its block of 16 keys."""
    g = torch.Generator().manual_seed(window)
    s, n = 70, 5
    keys = torch.randn(1, 2, s, 32, generator=g).to(kv_dtype)
    values = torch.randn(1, 2, s, 32, generator=g).to(kv_dtype)
    q = torch.randn(1, 6, n, 32, generator=g)
    got = OPS.decode_attention(q, keys, values, None, 0.2, window)
    want = decode_attention_ref(q, keys.float(), values.float(), None, 0.2, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for j in range(n):
        end = s - n + 1 + j
        k, v = keys[:, :, :end], values[:, :, :end]
        alone = OPS.decode_attention(q[:, :, j : j + 1], k, v, None, 0.2, window)
        assert torch.equal(alone[:, :, 0], got[:, :, j]), j
    if window >= s:  # a window past every key changes nothing
        assert torch.equal(got, OPS.decode_attention(q, keys, values, None, 0.2))


def test_a_causal_prefill_past_the_window_windows_every_row():
    g = torch.Generator().manual_seed(3)
    s = 40
    keys, values = torch.randn(1, 1, s, 16, generator=g), torch.randn(1, 1, s, 16, generator=g)
    q = torch.randn(1, 2, s, 16, generator=g)  # every slot's row: a prefill from an empty cache
    got = OPS.decode_attention(q, keys, values, None, 0.3, 6)
    torch.testing.assert_close(got, decode_attention_ref(q, keys, values, None, 0.3, 6), rtol=1e-5, atol=1e-6)


def test_a_window_and_a_mask_both_hide_keys():
    """A left-padded batch row of a sliding layer: its mask hides the padding, the window the
    keys too far back."""
    g = torch.Generator().manual_seed(5)
    s = 50
    keys, values = torch.randn(2, 2, s, 16, generator=g), torch.randn(2, 2, s, 16, generator=g)
    q = torch.randn(2, 4, 1, 16, generator=g)
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[0, :9] = False
    mask[1, 30:33] = False
    got = OPS.decode_attention(q, keys, values, mask, 0.25, 24)
    want = decode_attention_ref(q, keys, values, mask, 0.25, 24)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="window"):
        OPS.decode_attention(q, keys, values, None, 0.25, -1)


def test_rope_qkv_normed_norms_q_and_k_heads_before_rotating():
    g = torch.Generator().manual_seed(2)
    hq, hk, dh, n = 4, 1, 32, 3
    qkv = (torch.randn(2, n, (hq + 2 * hk) * dh, generator=g) * 3).bfloat16()
    cos, sin = torch.rand(n, dh, generator=g), torch.rand(n, dh, generator=g)
    qw, kw = torch.rand(dh, generator=g) + 0.5, torch.rand(dh, generator=g) + 0.5
    got = OPS.rope_qkv_normed(qkv, cos, sin, hq, hk, qw, kw, 1e-6)
    want = rope_qkv_normed_ref(qkv, cos, sin, hq, hk, qw, kw, 1e-6)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], OPS.rope_qkv(qkv, cos, sin, hq, hk)[2])  # v is not normed
    one = OPS.rope_qkv_normed(qkv[1:, 1:2], cos[1:2], sin[1:2], hq, hk, qw, kw, 1e-6)
    assert torch.equal(one[0][0, :, 0], got[0][1, :, 1])  # a row alone: same bits
    with pytest.raises(RuntimeError, match="qw, kw"):
        OPS.rope_qkv_normed(qkv, cos, sin, hq, hk, qw[:-1], kw, 1e-6)


def test_norm_add_norms_the_sublayer_output_before_adding_it():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 640, generator=g)
    w, w_next = torch.rand(640, generator=g) + 0.5, torch.rand(640, generator=g) + 0.5
    for y in ((torch.randn(5, 640, generator=g) * 7).bfloat16(), torch.randn(5, 640, generator=g) * 7):
        s, h = OPS.norm_add_rms_norm_bf16(x, y, w, w_next, 1e-6)
        s_ref, h_ref = norm_add_rms_norm_bf16_ref(x, y, w, w_next, 1e-6)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
        _close_bf16(h, h_ref)
        alone = OPS.norm_add_rms_norm_bf16(x[3:4], y[3:4], w, w_next, 1e-6)
        assert torch.equal(alone[0][0], s[3]) and torch.equal(alone[1][0], h[3])


def test_gelu_mul_matches_the_tanh_gelu_over_a_wide_range():
    g = torch.Generator().manual_seed(6)
    gate = torch.linspace(-90, 90, 2048)[None].repeat(2, 1)
    gu = torch.cat([gate, torch.randn(2, 2048, generator=g) * 3], dim=-1).bfloat16()
    out = OPS.gelu_mul_bf16(gu)
    assert torch.isfinite(out.float()).all()
    ref = gelu_mul_bf16_ref(gu)
    # bf16 output; ~0 where the gate is near -90
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-4)
    assert torch.equal(out[1], OPS.gelu_mul_bf16(gu[1:2])[0])

"""Big CPU tensors in 2 MB pages: when they are asked for, what a mapping looks like, and that
moving a quantised model's weights (or allocating its cache) there changes no bit."""

from __future__ import annotations

import pytest
import torch

from evospec.models import huge_pages
from evospec.models.kv_cache import KVCache
from evospec.models.quant import quantize_linears
from tests.decoding.spec_helpers import tiny_target


@pytest.fixture
def asked(monkeypatch):
    """Every tensor of 4 KB or more asked for in huge pages, as on a kernel set to madvise."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=huge_pages.THP_FILE: "madvise")
    monkeypatch.delenv(huge_pages.ENV, raising=False)


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"), ("garbled\n", None)],
)
def test_thp_mode_reads_the_bracketed_word(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert huge_pages.thp_mode(f) == mode
    assert huge_pages.thp_mode(tmp_path / "missing") is None


def test_huge_pages_are_asked_for_only_where_they_help(monkeypatch, asked):
    assert huge_pages.wanted(1 << 20)
    assert not huge_pages.wanted(1024)  # small: where torch puts it
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.wanted(1 << 20)  # switched off
    monkeypatch.delenv(huge_pages.ENV)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda path=None: "never")
    assert not huge_pages.wanted(1 << 20)  # the kernel would refuse


def test_huge_zeros_is_aligned_zeroed_and_writable(asked):
    t = huge_pages.huge_zeros((3, 5, 1000), torch.float16)
    assert t.shape == (3, 5, 1000) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert not t.any()
    t.fill_(2.0)
    assert float(t.float().sum()) == 2.0 * t.numel()
    small = huge_pages.huge_zeros((4,), torch.float32)  # under MIN_BYTES: torch's own
    assert torch.equal(small, torch.zeros(4))


def test_a_refused_mapping_falls_back_to_torch(monkeypatch, asked):
    def refuse(*args, **kwargs):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    t = huge_pages.huge_zeros((2, 4096), torch.float32)
    assert torch.equal(t, torch.zeros(2, 4096))


def test_a_large_cpu_cache_lives_in_huge_pages(asked):
    cache = KVCache(2, 2, 16, 64, dtype=torch.float16)
    assert cache.k.data_ptr() % huge_pages.HUGE == 0 and cache.v.data_ptr() % huge_pages.HUGE == 0
    assert cache.k.shape == (2, 1, 2, 64, 16) and not cache.k.any()


def test_adopting_the_weights_moves_each_once_and_changes_no_bit(asked):
    model = tiny_target(0, head_dim=16)
    quantize_linears(model, "int4", stream=True)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = model(tokens, torch.arange(9), model.new_cache(12), logits="all").logits
    attn = model.layers[0].self_attn
    old = attn.qkv.packed
    moved = huge_pages.adopt_weights(model)
    assert moved > 0 and moved % 4096 == 0
    assert attn.qkv.packed is not old and torch.equal(attn.qkv.packed, old)
    assert attn.q_proj.matmul is attn.qkv  # the projections share the fused product's object
    assert attn.qkv.packed.data_ptr() % 4096 == 0
    with torch.inference_mode():
        after = model(tokens, torch.arange(9), model.new_cache(12), logits="all").logits
    assert torch.equal(before, after)


def test_nothing_moves_where_huge_pages_are_not_wanted(monkeypatch, asked):
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = tiny_target(0, head_dim=16)
    quantize_linears(model, "int4", stream=True)
    old = model.layers[0].self_attn.qkv.packed
    assert huge_pages.adopt_weights(model) == 0
    assert model.layers[0].self_attn.qkv.packed is old


def test_huge_copy_copies_where_wanted_and_is_a_no_op_elsewhere(monkeypatch, asked):
    t = torch.arange(5000, dtype=torch.int32).view(50, 100)
    c = huge_pages.huge_copy(t)
    assert c is not t and torch.equal(c, t) and c.data_ptr() % huge_pages.HUGE == 0
    c[0, 0] = -1  # its own bytes
    assert t[0, 0] == 0
    assert huge_pages.huge_copy(t.t()).data_ptr() == t.data_ptr()  # a strided view: left where it is
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert huge_pages.huge_copy(t) is t


def test_a_drafts_quantised_copy_is_adopted_and_drafts_the_same(monkeypatch, asked):
    from evospec.models.eagle import new_eagle_for, quantised_head
    from evospec.models.quant import Int4Matmul

    target = tiny_target(0, head_dim=16)
    head = new_eagle_for(target, seed=3)
    twin = quantised_head(head, "int4")
    mats = {id(o): o for m in twin.modules() for o in vars(m).values() if isinstance(o, Int4Matmul)}
    ptrs = sorted(o.packed.data_ptr() for o in mats.values())
    assert mats and all(p % 4096 == 0 for p in ptrs)
    assert ptrs[0] % huge_pages.HUGE == 0  # one mapping, from its first 2 MB boundary
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 4, target.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 4), generator=g)
    monkeypatch.setattr(huge_pages, "wanted", lambda nbytes: False)
    plain = quantised_head(head, "int4")
    with torch.inference_mode():
        outs = [
            h.attach(target)(feats, tokens, torch.arange(4), h.new_cache(8), None)[0] for h in (twin, plain)
        ]
    assert torch.equal(*outs)

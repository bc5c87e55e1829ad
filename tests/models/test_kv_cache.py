"""KVCache verbs (write, advance, trim, compact) on their own and through the model."""

from __future__ import annotations

import pytest
import torch

from evospec.models.kv_cache import KVCache
from tests.conftest import (
    TREE_PARENTS,
    TinyPair,
    full_forward,
    random_tokens,
    tiny_models,
    tree_mask_and_depths,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request: pytest.FixtureRequest) -> TinyPair:
    return tiny_models(request.param, seed=21)


def test_write_returns_prefix_and_new_slots() -> None:
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, max_len=5)
    k1, v1 = torch.full((1, 1, 2, 2), 1.0), torch.full((1, 1, 2, 2), -1.0)
    keys, values = cache.write(0, k1, v1)
    assert keys.shape == (1, 1, 2, 2) and torch.equal(keys, k1) and torch.equal(values, v1)
    assert cache.length == 0  # only advance() moves it
    cache.advance(2)
    keys, _ = cache.write(0, torch.full((1, 1, 1, 2), 2.0), torch.zeros(1, 1, 1, 2))
    assert keys[0, 0, :, 0].tolist() == [1.0, 1.0, 2.0]
    assert cache.k[1].abs().sum() == 0  # other layers untouched


def test_overflow_raises_and_keeps_length() -> None:
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=3)
    cache.write(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    cache.advance(2)
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert cache.length == 2


def test_model_forward_overflow_raises(pair: TinyPair) -> None:
    cache = pair.ours.new_cache(4)
    pair.ours(random_tokens(3), torch.arange(3), cache)
    with pytest.raises(ValueError, match="overflow"):
        pair.ours(random_tokens(2), torch.arange(3, 5), cache)
    assert cache.length == 3


def test_trim_bounds_and_reset() -> None:
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4)
    cache.advance(3)
    with pytest.raises(ValueError):
        cache.trim(4)
    with pytest.raises(ValueError):
        cache.trim(-1)
    cache.trim(1)
    assert cache.length == 1
    cache.reset()
    assert cache.length == 0


def test_trim_then_redecode_equals_fresh_decode(pair: TinyPair) -> None:
    model = pair.ours
    prompt, old, new = random_tokens(12, seed=1), random_tokens(5, seed=2), random_tokens(4, seed=3)
    cache = model.new_cache(20)
    model(prompt, torch.arange(12), cache, logits="none")
    model(old, torch.arange(12, 17), cache, logits="none")  # later rejected
    cache.trim(12)
    outs = [model(new[:, i : i + 1], torch.tensor([12 + i]), cache).logits for i in range(4)]
    fresh = full_forward(model, torch.cat([prompt, new], dim=1))[:, 12:]
    assert (torch.cat(outs, dim=1) - fresh).abs().max() <= TOL


def test_compact_equals_running_only_the_accepted_path(pair: TinyPair) -> None:
    model, prefix = pair.ours, 10
    mask, depths, paths = tree_mask_and_depths(TREE_PARENTS)
    accepted = paths[6]  # 0 -> 1 -> 3 -> 6: a path that skips slots
    assert accepted == [0, 1, 3, 6]
    prompt, nodes, nxt = (
        random_tokens(prefix, seed=4),
        random_tokens(len(TREE_PARENTS), seed=5),
        random_tokens(1, 6),
    )
    cache = model.new_cache(prefix + len(TREE_PARENTS) + 1)
    model(prompt, torch.arange(prefix), cache, logits="none")
    model(nodes, prefix + torch.tensor(depths), cache, tree_mask=mask, logits="none")
    cache.compact(prefix + torch.tensor(accepted), prefix)
    assert cache.length == prefix + len(accepted)

    path_seq = torch.cat([prompt, nodes[:, accepted]], dim=1)
    fresh = model.new_cache(path_seq.shape[1] + 1)
    model(path_seq, torch.arange(path_seq.shape[1]), fresh, logits="none")
    n = cache.length
    assert torch.allclose(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5)
    assert torch.allclose(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5)
    out = model(nxt, torch.tensor([n]), cache).logits
    ref = model(nxt, torch.tensor([n]), fresh).logits
    assert (out - ref).abs().max() <= TOL


def test_compact_nothing_accepted_truncates() -> None:
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, max_len=6)
    cache.advance(6)
    cache.compact(torch.tensor([], dtype=torch.long), 4)
    assert cache.length == 4


def test_compact_moves_slots_in_order() -> None:
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=6, batch=2)
    cache.k[...] = torch.arange(6.0).view(1, 1, 1, 6, 1)
    cache.v[...] = -torch.arange(6.0).view(1, 1, 1, 6, 1)
    cache.advance(6)
    cache.compact(torch.tensor([3, 5]), 2)
    assert cache.length == 4
    assert cache.k[1, 1, 0, :4, 0].tolist() == [0.0, 1.0, 3.0, 5.0]
    assert cache.v[0, 0, 0, :4, 0].tolist() == [0.0, -1.0, -3.0, -5.0]


@pytest.mark.parametrize(
    ("src", "want"),
    [
        ([2, 3], [0, 1, 2, 3]),
        ([2, 4], [0, 1, 2, 4]),
        ([2, 3, 5], [0, 1, 2, 3, 5]),
        ([2, 4, 5], [0, 1, 2, 4, 5]),
    ],
)
def test_compact_moves_only_the_slots_out_of_place(src: list[int], want: list[int]) -> None:
    """A path whose first nodes already sit behind the prefix (a fan's first child, a chain's
    head) moves only the rest: one slot, or several, to the same end."""
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=1, max_len=6)
    cache.k[...] = torch.arange(6.0).view(1, 1, 1, 6, 1)
    cache.v[...] = -torch.arange(6.0).view(1, 1, 1, 6, 1)
    cache.advance(6)
    cache.compact(torch.tensor(src), 2)
    assert cache.length == len(want)
    assert cache.k[1, 0, 0, : len(want), 0].tolist() == [float(s) for s in want]
    assert cache.v[0, 0, 0, : len(want), 0].tolist() == [-float(s) for s in want]


def test_new_cache_matches_model(pair: TinyPair) -> None:
    cache = pair.ours.new_cache(7, batch=3)
    cfg = pair.cfg
    assert cache.k.shape == (cfg.num_layers, 3, cfg.num_kv_heads, 7, cfg.head_dim)
    assert cache.batch == 3 and cache.max_len == 7 and cache.length == 0

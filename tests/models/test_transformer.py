"""Transformer forward: parity with transformers, incremental decoding and tree-masked verification."""

from __future__ import annotations

import copy

import pytest
import torch

from evospec.models.transformer import Transformer
from tests.conftest import (
    FAMILIES,
    GEMMA_WINDOW,
    TREE_PARENTS,
    TinyPair,
    full_forward,
    hf_logits,
    random_tokens,
    tiny_models,
    tree_mask_and_depths,
)

TOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest) -> TinyPair:
    return tiny_models(request.param, seed=3)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_full_forward_matches_transformers(pair: TinyPair) -> None:
    n = 3 * GEMMA_WINDOW  # longer than gemma3's sliding window
    tokens = random_tokens(n, seed=1, batch=2)
    ref = hf_logits(pair.hf, tokens)
    assert ref.std() > 0.3, "random weights too small for a meaningful comparison"
    ours = full_forward(pair.ours, tokens)
    assert ours.shape == (2, n, pair.cfg.vocab_size)
    assert _max_diff(ours, ref) <= TOL


def test_gemma3_final_logit_softcapping_matches_transformers() -> None:
    p = tiny_models("gemma3", seed=4, final_logit_softcapping=5.0)
    tokens = random_tokens(20, seed=2)
    ours = full_forward(p.ours, tokens)
    assert ours.abs().max() <= 5.0
    assert _max_diff(ours, hf_logits(p.hf, tokens)) <= TOL


def test_prefill_then_decode_equals_full_forward(pair: TinyPair) -> None:
    """Prefill 5, a chunk of 6 after a prefix, then one token at a time, past gemma's window."""
    model, n = pair.ours, 2 * GEMMA_WINDOW + 4
    tokens = random_tokens(n, seed=5, batch=2)
    full = full_forward(model, tokens)
    cache = model.new_cache(n, batch=2)
    pieces = []
    for start, end in [(0, 5), (5, 11), *((i, i + 1) for i in range(11, n))]:
        out = model(tokens[:, start:end], torch.arange(start, end), cache)
        assert cache.length == end
        pieces.append(out.logits)
    assert _max_diff(torch.cat(pieces, dim=1), full) <= TOL
    assert _max_diff(full, hf_logits(pair.hf, tokens)) <= TOL


def test_logits_modes_hidden_and_aux(pair: TinyPair) -> None:
    model = pair.ours
    tokens = random_tokens(6, seed=6)
    pos = torch.arange(6)
    full = model(tokens, pos, model.new_cache(6), aux_layers=(0, 2))
    last = model(tokens, pos, model.new_cache(6), logits="last")
    none = model(tokens, pos, model.new_cache(6), logits="none")
    assert last.logits.shape == (1, 1, pair.cfg.vocab_size)
    assert _max_diff(last.logits[0, 0], full.logits[0, -1]) <= TOL
    assert none.logits is None
    assert full.hidden.shape == (1, 6, pair.cfg.hidden_size)
    assert torch.allclose(none.hidden, full.hidden)
    assert [a.shape for a in full.aux_hidden] == [(1, 6, pair.cfg.hidden_size)] * 2
    with torch.inference_mode():
        hs = pair.hf(input_ids=tokens, output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is layer i's output (the last one after the final norm in HF).
    assert _max_diff(full.aux_hidden[0], hs[1]) <= TOL
    assert _max_diff(full.hidden, hs[-1]) <= TOL


@pytest.mark.parametrize("prefix", [0, 5, 2 * GEMMA_WINDOW])
def test_chain_tree_mask_equals_causal(pair: TinyPair, prefix: int) -> None:
    model, k = pair.ours, 6
    tokens = random_tokens(prefix + k, seed=7)
    causal = full_forward(model, tokens)[:, prefix:]
    cache = model.new_cache(prefix + k)
    if prefix:
        model(tokens[:, :prefix], torch.arange(prefix), cache, logits="none")
    chain = torch.ones(k, k, dtype=torch.bool).tril()
    out = model(tokens[:, prefix:], torch.arange(prefix, prefix + k), cache, tree_mask=chain)
    assert cache.length == prefix + k
    assert _max_diff(out.logits, causal) <= TOL


@pytest.mark.parametrize("prefix", [0, 4, 2 * GEMMA_WINDOW + 1])
def test_branching_tree_matches_each_root_to_node_path(pair: TinyPair, prefix: int) -> None:
    model = pair.ours
    mask, depths, paths = tree_mask_and_depths(TREE_PARENTS)
    n = len(TREE_PARENTS)
    prompt = random_tokens(max(prefix, 1), seed=8)[:, :prefix]
    nodes = random_tokens(n, seed=9)
    cache = model.new_cache(prefix + n)
    if prefix:
        model(prompt, torch.arange(prefix), cache, logits="none")
    out = model(nodes, prefix + torch.tensor(depths), cache, tree_mask=mask)
    for i, path in enumerate(paths):
        seq = torch.cat([prompt, nodes[:, path]], dim=1)
        ref = full_forward(model, seq)[0, -1]
        assert _max_diff(out.logits[0, i], ref) <= TOL, f"node {i} (path {path})"


def test_prefix_cache_is_not_disturbed_by_tree(pair: TinyPair) -> None:
    """Decoding after a tree at the committed length ignores the tree's stale slots after trim."""
    model, prefix = pair.ours, 10
    tokens = random_tokens(prefix + 1, seed=10)
    mask, depths, _ = tree_mask_and_depths(TREE_PARENTS)
    cache = model.new_cache(prefix + 1 + len(TREE_PARENTS))
    model(tokens[:, :prefix], torch.arange(prefix), cache, logits="none")
    model(random_tokens(len(TREE_PARENTS), seed=11), prefix + torch.tensor(depths), cache, tree_mask=mask)
    cache.trim(prefix)
    out = model(tokens[:, prefix:], torch.tensor([prefix]), cache)
    assert _max_diff(out.logits[0, -1], full_forward(model, tokens)[0, -1]) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_matches_cpu(family: str) -> None:
    p = tiny_models(family, seed=12)
    tokens = random_tokens(20, seed=13)
    nodes = random_tokens(len(TREE_PARENTS), seed=14)
    mask, depths, paths = tree_mask_and_depths(TREE_PARENTS)
    ref_full = full_forward(p.ours, tokens)
    ref_paths = [full_forward(p.ours, torch.cat([tokens, nodes[:, path]], dim=1))[0, -1] for path in paths]
    gpu: Transformer = copy.deepcopy(p.ours).to("cuda")
    assert _max_diff(full_forward(gpu, tokens.cuda()).cpu(), ref_full) <= 1e-3
    cache = gpu.new_cache(20 + len(TREE_PARENTS))
    gpu(tokens.cuda(), torch.arange(20, device="cuda"), cache, logits="none")
    tree = gpu(nodes.cuda(), (20 + torch.tensor(depths)).cuda(), cache, tree_mask=mask.cuda())
    for i, ref in enumerate(ref_paths):
        assert _max_diff(tree.logits[0, i].cpu(), ref) <= 1e-3, f"node {i}"

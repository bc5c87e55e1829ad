"""Recorded draft steps compute what the eager head computes, at every position, row count and
input width, for EAGLE-2 and EAGLE-3 heads."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.drafter import EagleDrafter, FullHead
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.draft_step import DraftStepGraph, supports_draft_graph
from evospec.models.eagle import new_eagle_for, quantised_head
from evospec.models.eagle3 import new_eagle3_for
from evospec.models.packing import pack_linears
from tests.decoding.spec_helpers import ar_tokens, prompt_of, spec_events, tiny_target


def _heads(target, arch="eagle2"):
    if arch == "eagle3":
        head = new_eagle3_for(target, seed=3, tied=True).attach(target)
    else:
        head = new_eagle_for(target, seed=3).attach(target)
    out = {"fp32": head}
    from evospec.models.quant import kernels_available

    if kernels_available("int8"):
        out["int8"] = quantised_head(head, "int8").attach(target)
    return out


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_graph_steps_match_the_eager_head(fmt, arch):
    target = tiny_target(0)
    heads = _heads(target, arch)
    if fmt not in heads:
        pytest.skip("torch without the int8 CPU kernel")
    head = heads[fmt]
    graph = DraftStepGraph(head)
    d = head.cfg.hidden_size
    wide = 3 * d if arch == "eagle3" else d  # what a commit reads: EAGLE-3 fuses three target layers
    gen = torch.Generator().manual_seed(0)
    eager_cache, graph_cache = head.new_cache(64), head.new_cache(64)
    # a prefill-like start, then catch-ups of several sizes, and one-row expansions on own features
    steps = [(3, wide), (1, wide), (1, d), (2, wide), (1, d), (1, wide), (4, wide)]
    with torch.inference_mode():
        for n, width in steps:
            feats = torch.randn(n, width, generator=gen)
            toks = torch.randint(0, target.cfg.vocab_size, (n,), generator=gen)
            start = eager_cache.length
            pos = torch.arange(start, start + n)
            mask = torch.ones(n, start + n, dtype=torch.bool).tril(start) if start and n > 1 else None
            want = head(feats[None], toks[None], pos, eager_cache, mask)[0]
            got = graph(feats, toks, pos, graph_cache)
            assert got is not None and graph_cache.length == eager_cache.length
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            end = eager_cache.length
            torch.testing.assert_close(graph_cache.k[..., :end, :], eager_cache.k[..., :end, :])
    # one graph per row count and width, reused across positions
    assert sorted(graph._graphs) == sorted({(n, w) for n, w in steps})
    if arch == "eagle3":  # several rows of the head's own features: no such step, the caller runs eager
        pairs = (torch.zeros(2, d), torch.zeros(2, dtype=torch.long), torch.arange(2))
        with torch.inference_mode():
            assert graph(*pairs, graph_cache) is None


def test_packed_heads_keep_the_eager_step():
    target = tiny_target(0)
    assert supports_draft_graph(new_eagle3_for(target, seed=1))
    head = new_eagle_for(target, seed=1)
    if pack_linears(head) == 0:
        pytest.skip("torch built without oneDNN")
    assert not supports_draft_graph(head)
    with pytest.raises(ValueError, match="needs an EAGLE head"):
        DraftStepGraph(head)


@pytest.mark.parametrize("tree", [TreeConfig(1, 3, 3), TreeConfig(1, 1, 1, lookup=3, lookup_ngram=1)])
def test_a_recording_drafter_proposes_what_the_eager_one_proposes(tree):
    """Same proposals round by round (so the same acceptance), and AR's output."""
    target = tiny_target(0)
    head = new_eagle_for(target, seed=5).attach(target)
    params = SamplingParams(max_new_tokens=30)
    for seed in range(3):
        prompt = prompt_of(seed, 6 + seed)
        runs = []
        for record in (False, True):
            drafter = EagleDrafter(head, FullHead(target.lm_head.weight), record=record)
            assert (drafter.graph is not None) == record
            runs.append(spec_events(target, drafter, prompt, params, tree))
        eager, recorded = runs
        assert [ev.accepted for ev in eager] == [ev.accepted for ev in recorded]
        assert [t for ev in recorded for t in ev.tokens] == ar_tokens(target, prompt, params)


@pytest.mark.parametrize("tree", [TreeConfig(1, 3, 3), TreeConfig(1, 1, 1, lookup=3, lookup_ngram=1)])
def test_an_eagle3_decoder_records_its_draft_steps_and_proposes_as_eagerly(tree):
    """EAGLE-3 commits (three target layers) and chain expansions (own features) run recorded;
    rounds accept what the eager drafter's accept, and the output is AR's."""
    from evospec.decoding.methods import make_decoder

    target = tiny_target(0)
    head = new_eagle3_for(target, seed=5, tied=True)
    params = SamplingParams(max_new_tokens=30)
    dec = make_decoder("eagle3", target, draft=head, tree=tree)
    graph = dec.drafter.graph
    assert graph is not None
    for seed in range(3):
        prompt = prompt_of(seed, 6 + seed)
        dec.drafter.graph = graph
        recorded = list(dec.generate(prompt, params))
        dec.drafter.graph = None
        eager = list(dec.generate(prompt, params))
        assert [ev.accepted for ev in eager] == [ev.accepted for ev in recorded]
        assert [t for ev in recorded for t in ev.tokens] == ar_tokens(target, prompt, params)
    wide, own = 3 * head.cfg.hidden_size, head.cfg.hidden_size
    assert {(1, wide), (1, own)} <= set(graph._graphs)  # a one-row step may read either width

"""The recorded one-token step: bitwise the eager step at every length, on every cache."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.packing import pack_linears
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph, supports_step_graph
from tests.decoding.spec_helpers import ar_tokens, perturbed_drafter, prompt_of, spec_tokens, tiny_target


def _steps(model, prompt: list[int], n: int, max_len: int):
    """Greedy one-token steps after ``prompt``: per step (logits [V], hidden [D]), and the cache."""
    cache = model.new_cache(max_len)
    out = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, logits="last")
    tok, seen = out.logits[0, -1].argmax(), []
    for _ in range(n):
        out = model(tok.view(1, 1), torch.tensor([cache.length]), cache, logits="last")
        seen.append((out.logits[0, -1].clone(), out.hidden[0, -1].clone()))
        tok = out.logits[0, -1].argmax()
    return seen, cache


def _formats():
    return ["fp32"] + [f for f in ("int4", "int8", "bf16") if kernels_available(f)]


@pytest.mark.parametrize("fmt", _formats())
def test_recorded_steps_are_bitwise_the_eager_steps(fmt):
    model = tiny_target(3)
    if fmt != "fp32":
        quantize_linears(model, fmt)
    prompt = prompt_of(2, 5)
    eager, eager_cache = _steps(model, prompt, 40, 64)
    model.step_graph = StepGraph(model)
    # two caches of other sizes: one graph serves every length and every cache
    for max_len in (48, 120):
        graph, cache = _steps(model, prompt, 40, max_len)
        for (le, he), (lg, hg) in zip(eager, graph, strict=True):
            assert torch.equal(le, lg) and torch.equal(he, hg)
        n = cache.length
        assert n == eager_cache.length
        assert torch.equal(cache.k[..., :n, :], eager_cache.k[..., :n, :])
        assert torch.equal(cache.v[..., :n, :], eager_cache.v[..., :n, :])


def test_the_graph_is_recorded_once_and_on_scratch_buffers():
    model = tiny_target(1)
    graph = model.step_graph = StepGraph(model)
    cache = model.new_cache(16)
    model(torch.tensor([[1, 2, 3]]), torch.arange(3), cache)
    before = cache.k.clone()
    model(torch.tensor([[4]]), torch.tensor([3]), cache)
    recorded = dict(graph._graphs)
    assert list(recorded) == [(1, "all")]
    assert torch.equal(cache.k[..., :3, :], before[..., :3, :])  # recording wrote nothing real
    assert torch.equal(cache.k[..., 4:, :], before[..., 4:, :])
    model(torch.tensor([[5]]), torch.tensor([4]), cache)
    assert graph._graphs == recorded and cache.length == 5


def _verify(model, prompt: list[int], chain: list[int], tree_mask, logits: str):
    """One verification forward of ``chain`` after ``prompt``: (logits, hidden, cache keys)."""
    cache = model.new_cache(64)
    model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, logits="none")
    p = len(prompt)
    out = model(torch.tensor([chain]), torch.arange(p, p + len(chain)), cache, tree_mask, logits=logits)
    return out.logits, out.hidden, cache.k[..., : cache.length, :].clone()


@pytest.mark.parametrize("fmt", _formats())
@pytest.mark.parametrize("logits", ["all", "last", "none"])
def test_recorded_chain_verification_is_bitwise_the_row_exact_forward(fmt, logits):
    model = tiny_target(5)
    if fmt != "fp32":
        quantize_linears(model, fmt)
    model.exact_rows = True
    prompt, chain = prompt_of(4, 7), prompt_of(5, 4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    want = _verify(model, prompt, chain, causal, logits)
    graph = model.step_graph = StepGraph(model)
    for mask in (causal, None):  # a chain spelled as a tree mask, or plainly causal
        got = _verify(model, prompt, chain, mask, logits)
        for a, b in zip(want, got, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
    # verifying chains are recorded; a prompt's rest after reused slots ("last") runs eagerly
    assert ((4, logits) in graph._graphs) == (logits != "last")
    # a branching tree keeps the eager row path
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    before = dict(graph._graphs)
    model.step_graph = None
    eager = _verify(model, prompt, chain[:3], tree, "all")
    model.step_graph = graph
    assert torch.equal(_verify(model, prompt, chain[:3], tree, "all")[0], eager[0])
    assert graph._graphs == before


def test_overflow_is_a_clear_error():
    model = tiny_target(1)
    model.step_graph = StepGraph(model)
    cache = model.new_cache(4)
    model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4), cache)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.tensor([[5]]), torch.tensor([4]), cache)


def test_reset_records_the_swapped_modules():
    if not kernels_available("int4"):
        pytest.skip("torch without CPU int4 kernels")
    model = tiny_target(4)
    prompt = prompt_of(1, 4)
    model.step_graph = StepGraph(model)
    fp32_steps, _ = _steps(model, prompt, 6, 32)
    quantize_linears(model, "int4")
    model.step_graph.reset()
    graph_steps, _ = _steps(model, prompt, 6, 32)
    model.step_graph = None
    eager_steps, _ = _steps(model, prompt, 6, 32)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(graph_steps, eager_steps, strict=True))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(graph_steps, fp32_steps, strict=True))


def test_unsupported_models_keep_the_eager_step():
    assert not supports_step_graph(tiny_target(0, family="gemma3"))  # sliding-window masks
    packed = tiny_target(0)
    if pack_linears(packed):
        assert not supports_step_graph(packed)  # oneDNN's opaque packed weights
    with pytest.raises(ValueError, match="sliding"):
        StepGraph(tiny_target(0, family="gemma3"))


@pytest.mark.parametrize("seed", range(3))
def test_speculative_output_equals_ar_with_recorded_steps(seed):
    """AR steps run the graph, verification runs row by row in eager: still token for token."""
    if not kernels_available("int4"):
        pytest.skip("torch without CPU int4 kernels")
    target = tiny_target(6)
    quantize_linears(target, "int4")
    target.exact_rows = True
    target.step_graph = StepGraph(target)
    drafter = perturbed_drafter(target, noise=0.6, seed=seed)
    prompt = prompt_of(seed, 4 + 3 * seed)
    params = SamplingParams(max_new_tokens=24)
    tree = TreeConfig(top_k=4, depth=4, total_tokens=12)
    assert spec_tokens(target, drafter, prompt, params, tree) == ar_tokens(target, prompt, params)


def test_a_failed_recording_falls_back_to_the_eager_step(monkeypatch, caplog):
    model = tiny_target(2)
    prompt = prompt_of(3, 4)
    eager, _ = _steps(model, prompt, 5, 32)
    model.step_graph = StepGraph(model)

    def refuse(*a, **k):
        raise RuntimeError("tracer unavailable")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    with caplog.at_level("WARNING"):
        fallback, _ = _steps(model, prompt, 5, 32)
    assert model.step_graph.failed
    assert sum("could not record" in r.message for r in caplog.records) == 1  # said once
    assert all(torch.equal(a[0], b[0]) for a, b in zip(eager, fallback, strict=True))


def test_graphs_recorded_ahead_serve_the_later_forwards():
    model = tiny_target(7)
    model.exact_rows = True
    graph = model.step_graph = StepGraph(model)
    assert graph.record(1, "last") and graph.record(3, "all")
    recorded = {k: id(v) for k, v in graph._graphs.items()}
    prompt = prompt_of(1, 5)
    _steps(model, prompt, 3, 32)
    _verify(model, prompt, prompt_of(2, 3), None, "all")
    assert {k: id(v) for k, v in graph._graphs.items()} == recorded  # nothing recorded again
    graph.record(17, "all")
    assert (17, "all") not in graph._graphs  # past MAX_CHAIN: such forwards stay eager


@pytest.mark.parametrize("n", [1, 3])
def test_recorded_forwards_return_the_aux_layers_bitwise(n):
    """EAGLE-3 drafts read three target layers: a recorded step or chain returns them too."""
    model = tiny_target(8)
    model.exact_rows = True
    prompt, chain = prompt_of(3, 6), prompt_of(4, n)

    def run():
        cache = model.new_cache(32)
        model(torch.tensor([prompt]), torch.arange(6), cache, logits="none")
        out = model(torch.tensor([chain]), torch.arange(6, 6 + n), cache, logits="all", aux_layers=(1, 0, 1))
        return out.logits, out.aux_hidden

    want_logits, want_aux = run()
    graph = model.step_graph = StepGraph(model)
    got_logits, got_aux = run()
    assert (n, "all", (1, 0, 1)) in graph._graphs
    assert torch.equal(got_logits, want_logits) and len(got_aux) == 3
    assert all(torch.equal(a, b) for a, b in zip(got_aux, want_aux, strict=True))

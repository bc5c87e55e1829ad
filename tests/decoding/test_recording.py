"""record_steps records and warms every graph the decoders will run, before any request."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import make_decoder
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import MAX_CHAIN, StepGraph, supports_step_graph
from tests.decoding.spec_helpers import ar_tokens, prompt_of, tiny_target


@pytest.fixture(scope="module")
def target():
    if not kernels_available("int8"):
        pytest.skip("torch without CPU int8 kernels")
    model = tiny_target(3)
    quantize_linears(model, "int8")  # a quantised target drafts with the recorded int8 copy
    model.exact_rows = True
    assert supports_step_graph(model)
    model.step_graph = StepGraph(model)
    return model


def test_every_verify_length_and_draft_size_is_recorded_ahead(target):
    """A stopping chain verifies any of 1..depth drafted tokens and a lookup round 1..lookup
    tokens; a drafter's catch-up commits any of 1..MAX_CHAIN pairs: all are recorded, and a
    request then records nothing more."""
    stopping = TreeConfig(top_k=1, depth=4, total_tokens=4, lookup=3, min_prob=0.3)
    fixed = TreeConfig(top_k=1, depth=2, total_tokens=2)
    head = new_eagle_for(target)
    decoders = [make_decoder("eagle2", target, draft=head, tree=t) for t in (stopping, fixed)]
    draft_graph = decoders[0].drafter.graph
    assert draft_graph is not None and decoders[1].drafter.graph is draft_graph  # one per head
    record_steps(target, decoders)
    assert sorted(n for n, _ in draft_graph._graphs) == list(range(1, MAX_CHAIN + 1))
    recorded = set(target.step_graph._graphs)
    assert {(1, "last"), *((n, "all") for n in range(2, 6))} <= recorded  # 1-4 drafted, 1-3 looked up
    params = SamplingParams(max_new_tokens=30)
    prompt = prompt_of(2, 12)
    for dec in decoders:
        got = [t for ev in dec.generate(prompt, params) for t in ev.tokens]
        assert got == ar_tokens(target, prompt, params)
    assert set(target.step_graph._graphs) == recorded and len(draft_graph._graphs) == MAX_CHAIN

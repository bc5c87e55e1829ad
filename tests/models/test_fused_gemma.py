"""Gemma-3 blocks through the fused CPU ops: close to the aten path, row-exact past the window,
recorded, and lossless under speculative decoding."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.fused import enable_fused_ops, supports_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph, supports_step_graph
from tests.decoding.spec_helpers import ar_tokens, eagle_drafter, prompt_of, spec_tokens, tiny_target
from tests.models.test_fused import (
    _steps,
    assert_one_op_layers_match_the_loop,
    assert_padded_rows_decode_as_alone,
    assert_prefill_logits_close,
    assert_verification_reproduces_steps,
)

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)
WINDOW = 6  # tiny_target's sliding window: every test below runs well past it


def _gemma(seed: int, fused: bool = True, head_dim: int = 16):
    model = tiny_target(seed, family="gemma3", head_dim=head_dim)
    quantize_linears(model, "int4")
    model.exact_rows = True
    if fused:
        assert enable_fused_ops(model)
    return model


def test_gemma_takes_the_fused_ops_and_then_records_its_steps():
    model = _gemma(0, fused=False)
    assert model.cfg.sliding_window == WINDOW and supports_fused_ops(model)
    assert not supports_step_graph(model)  # eager sliding layers: position-dependent masks
    enable_fused_ops(model)
    assert supports_step_graph(model) and model.new_cache(4).k.dtype == torch.float16
    assert model.layers[0].fused_norms is not None  # its norms' 1 + w, computed once


@pytest.mark.parametrize("head_dim", [8, 16])
def test_fused_gemma_logits_stay_close_to_the_aten_path(head_dim):
    aten, fused = _gemma(2, fused=False, head_dim=head_dim), _gemma(2, head_dim=head_dim)
    assert_prefill_logits_close(aten, fused)
    # and one-token steps past the window agree with the aten path's masks
    a, f = _steps(aten, prompt_of(3, 4), 12), _steps(fused, prompt_of(3, 4), 12)
    assert sum(x[0] == y[0] for x, y in zip(a, f, strict=True)) >= 10


def test_recorded_gemma_steps_are_bitwise_the_eager_ones_and_one_op_per_layer():
    model = _gemma(3)
    prompt = prompt_of(2, 4)
    eager = _steps(model, prompt, 20)  # to position 24: four windows
    graph = model.step_graph = StepGraph(model)
    recorded = _steps(model, prompt, 20)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(eager, recorded, strict=True))
    code = str(graph._graphs[1, "last"].inlined_graph)
    if model.layers[0].self_attn.qkv.kernel == "vnni":
        assert code.count("evospec::gemma_layer") == len(model.layers)


@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_fused_gemma_verification_reproduces_one_token_steps_past_the_window(tree):
    model = _gemma(5)
    model.step_graph = StepGraph(model)
    assert_verification_reproduces_steps(model, prompt_of(4, 11), tree)


def test_a_fused_gemma_prefill_writes_what_one_token_steps_write():
    model = _gemma(6)
    prompt = prompt_of(5, 23)
    batched, stepped = model.new_cache(32), model.new_cache(32)
    out = model(torch.tensor([prompt]), torch.arange(23), batched, logits="all")
    for i, tok in enumerate(prompt):
        row = model(torch.tensor([[tok]]), torch.tensor([i]), stepped, logits="last")
        assert torch.equal(out.logits[0, i], row.logits[0, -1]), i
    assert torch.equal(batched.k[:, :, :, :23], stepped.k[:, :, :, :23])
    split = model.new_cache(32)  # the rest of a prompt after reused slots
    model(torch.tensor([prompt[:9]]), torch.arange(9), split, logits="none")
    tail = model(torch.tensor([prompt[9:]]), torch.arange(9, 23), split, logits="all")
    assert torch.equal(tail.logits[0], out.logits[0, 9:])


def test_one_gemma_op_per_layer_gives_the_op_by_op_loops_bits(monkeypatch):
    assert_one_op_layers_match_the_loop(_gemma(7), monkeypatch)


def test_a_padded_gemma_batch_decodes_each_row_as_alone():
    """Batched generation (training data): left padding plus the window, over the f16 cache."""
    assert_padded_rows_decode_as_alone(_gemma(8), prompt_of(1, 5), prompt_of(2, 12), 1e-3)


TREES = (TreeConfig(top_k=1, depth=3, total_tokens=3), TreeConfig(top_k=3, depth=3, total_tokens=8))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tree", TREES, ids=["chain", "tree"])
def test_speculative_decoding_on_fused_gemma_equals_plain_decoding(seed, tree):
    target = _gemma(10 + seed)
    target.step_graph = StepGraph(target)
    drafter = eagle_drafter(target, seed=seed)
    params = SamplingParams(max_new_tokens=30)
    prompt = prompt_of(seed, 5)
    assert spec_tokens(target, drafter, prompt, params, tree) == ar_tokens(target, prompt, params)

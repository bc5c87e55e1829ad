"""``scripts/row_costs.py``: the split of an n-row forward's time into int4 matmuls,
attention, LM head and the rest, on a tiny model through the fused CPU ops (wave 23)."""

from __future__ import annotations

import math

import pytest
import torch

from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.kernels.int4_matmul import vnni_available
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import tiny_target
from tests.script_modules import SCRIPTS, load_script

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4") and vnni_available()),
    reason="needs the fused CPU ops and their int4 kernels (AVX2 or later)",
)


def _script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports step_lengths.py from its folder, as when run
    return load_script("row_costs")


def test_part_costs_split_a_forward_into_its_ops(monkeypatch):
    script = _script(monkeypatch)
    model = tiny_target(0, head_dim=16)
    quantize_linears(model, "int4")
    model.exact_rows = True
    assert enable_fused_ops(model)
    graph, cache = StepGraph(model), model.new_cache(40)
    with torch.inference_mode():
        for n in (1, 3):
            graph.record(n, "last" if n == 1 else "all")
            cost = script.part_costs(model, graph, cache, 20, n, calls=2)
            assert set(cost) == set(script.PARTS)
            assert all(cost[p] > 0 for p in ("forward", "int4", "attention", "lm_head"))
            assert math.isclose(
                cost["rest"], cost["forward"] - cost["int4"] - cost["attention"] - cost["lm_head"]
            )
            assert cache.length == 20  # timing writes K/V slots past the length, never moves it

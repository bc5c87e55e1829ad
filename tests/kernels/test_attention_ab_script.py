"""``scripts/attention_ab.py``: two checkouts' decode attention in one process (wave 31)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from evospec.kernels.cpu_ops import load_cpu_ops
from tests.script_modules import load_script

needs_ops = pytest.mark.skipif(not load_cpu_ops(), reason="the fused CPU ops did not build here")


@needs_ops
def test_the_same_library_twice_gives_the_same_bits_on_every_shape():
    script = load_script("attention_ab")
    assert script.check_shapes([torch.ops.evospec, torch.ops.evospec]) > 300


@needs_ops
def test_a_library_whose_bits_differ_stops_the_comparison():
    script = load_script("attention_ab")

    def nudged(q, k, v, mask, scale, window):
        out = torch.ops.evospec.decode_attention(q, k, v, mask, scale, window)
        return torch.nextafter(out, torch.full_like(out, float("inf")))

    with pytest.raises(SystemExit, match="outputs differ"):
        script.check_shapes([torch.ops.evospec, SimpleNamespace(decode_attention=nudged)])


@needs_ops
def test_both_sides_are_timed_alternately_per_length_and_rows(capsys):
    script = load_script("attention_ab")
    calls = []

    def counted(name):
        def fn(q, k, v, mask, scale, window):
            calls.append((name, k.shape[2], q.shape[2]))
            return torch.ops.evospec.decode_attention(q, k, v, mask, scale, window)

        return SimpleNamespace(decode_attention=fn)

    script.time_pair([counted("a"), counted("b")], ["a", "b"], [20, 40], [1, 2], layers=2, calls=3, repeats=2)
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 20") or line.startswith("| 40")
    ]
    assert [r.split(" |")[0] for r in rows] == ["| 20 / 1", "| 20 / 2", "| 40 / 1", "| 40 / 2"]
    # per (length, rows): repeat 0 runs a then b, repeat 1 b then a, 3 calls each
    first = [name for name, s, n in calls if (s, n) == (20, 1)]
    assert first == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3


@pytest.mark.slow
@needs_ops
def test_a_tree_builds_under_its_own_namespace_beside_the_library():
    script = load_script("attention_ab")
    ops = script.load_tree(Path(__file__).parents[2], "evospec_abtest")
    q, k = torch.randn(1, 9, 2, 64), torch.randn(1, 3, 50, 64).half()
    assert torch.equal(
        ops.decode_attention(q, k, k, None, 0.125, 0),
        torch.ops.evospec.decode_attention(q, k, k, None, 0.125, 0),
    )

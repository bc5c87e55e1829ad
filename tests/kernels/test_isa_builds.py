"""The int8-activation kernels give the same bits under every instruction set they build for.

The default build takes the widest the CPU has (AVX-512 VNNI here); laptops without AVX-512
build the AVX-VNNI or plain AVX2 variants (``vnni.h``). Each is built here too, with
``EVOSPEC_CPU_CFLAGS`` switching AVX-512 (and AVX-VNNI) off, in a subprocess (one op library a
process), and must reproduce the default build's products, decode attention, fused logits and
greedy tokens exactly: integer dot products are exact, the float epilogues the same operations.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evospec.kernels.cpu_ops import EXTRA_CFLAGS_ENV, _cpu_flags, load_cpu_ops
from evospec.kernels.int4_matmul import kernel_isa, vnni_available
from tests.kernels.isa_outputs import outputs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and vnni_available() and {"avx2", "fma", "f16c"} <= set(_cpu_flags().split())),
    reason="needs the op library and a CPU with AVX2, FMA and F16C",
)


def _build_outputs(flags: str, tmp_path: Path, *extra: str) -> dict:
    path = tmp_path / "outputs.pt"
    env = {**os.environ, EXTRA_CFLAGS_ENV: flags, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.kernels.isa_outputs", str(path), *extra]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    return torch.load(path)


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        ("-mno-avx512f -mno-avxvnni", "avx2"),
        pytest.param("-mno-avx512f", "avx-vnni", marks=pytest.mark.slow),
    ],
)
def test_an_avx2_build_gives_the_default_builds_bits(flags, isa, tmp_path):
    if isa == "avx-vnni" and "avx_vnni" not in _cpu_flags().split():
        pytest.skip("this CPU has no AVX-VNNI")
    want, got = outputs(), _build_outputs(flags, tmp_path)
    assert got["isa"] == isa
    assert want.keys() == got.keys()
    for key in want:
        if key != "isa":
            assert torch.equal(want[key], got[key]), key


def test_kernel_isa_names_the_build_and_follows_the_cpu():
    flags = set(_cpu_flags().split())
    want = "avx512-vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx-vnni"
    if want == "avx-vnni" and "avx_vnni" not in flags:
        want = "avx2"
    assert kernel_isa() == want


def test_a_build_without_avx2_loads_and_runs_the_model_on_torchs_int4_products(tmp_path):
    """Below AVX2 the library has no int8-activation kernels (nor the layer team built on
    them); it must still load, say so, and give the model the same logits as plain torch ops
    (it once failed to link: the layer team's entry points were compiled out but still called)."""
    got = _build_outputs("-mno-avx2", tmp_path, "--fallback")
    assert got["loaded"] and got["isa"] == "none"
    assert got["fused"]
    torch.testing.assert_close(got["fused_logits"], got["plain_logits"], atol=2e-2, rtol=2e-2)

"""``scripts/attention_layouts.cpp``: the attention benchmark builds, runs, and each layout's scores
and weighted sums match a float64 reference (float32 ways exactly enough, bf16 ways within bf16's
rounding)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).parents[2] / "scripts" / "attention_layouts.cpp"


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(
    shutil.which("g++") is None or not _cpu_has("avx512_bf16"), reason="needs g++ and an AVX-512 BF16 CPU"
)
def test_the_benchmark_runs_and_every_layout_computes_the_scores(tmp_path):
    exe = tmp_path / "attention_layouts"
    subprocess.run(["g++", "-O2", "-march=native", "-o", str(exe), str(SOURCE)], check=True, timeout=120)
    out = subprocess.run(
        [str(exe), "3", "40", "5"], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    assert out.startswith("3 rows x 32 keys x 64 dims, 5 calls")  # keys round down to whole blocks
    line = r"^(\w+)\s+[\d.]+ ns per \(row, key\), max \|error\| ([\d.]+)"
    scores = dict(re.findall(line + "$", out, re.M))
    sums = dict(re.findall(line + r" \(weighted sum\)$", out, re.M))
    assert {"rows", "f16t", "bf16t"} <= scores.keys() and "rows" in sums
    assert (
        float(scores["rows"]) < 1e-4 and float(scores["f16t"]) < 1e-4 and float(sums["rows"]) < 1e-5
    )  # float32
    assert all(float(e) < 0.05 for e in scores.values())  # bf16 ways: q and k rounded to 8 significant bits
    assert all(float(e) < 2e-3 for e in sums.values())  # probabilities and values in bf16 (amx)
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr

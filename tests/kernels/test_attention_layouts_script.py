"""``scripts/attention_layouts.cpp``: the scores benchmark builds, runs, and each key layout's
scores match a float64 reference (float32 ways exactly enough, bf16 ways within bf16's rounding)."""

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
    errors = {
        m[0]: float(m[2])
        for m in re.findall(r"^(\w+)\s+([\d.]+) ns per \(row, key\), max \|error\| ([\d.]+)$", out, re.M)
    }
    assert {"rows", "f16t", "bf16t"} <= errors.keys()
    assert errors["rows"] < 1e-4 and errors["f16t"] < 1e-4  # float32 arithmetic on f16 keys
    assert all(e < 0.05 for e in errors.values())  # bf16 ways: q and k rounded to 8 significant bits
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr

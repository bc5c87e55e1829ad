"""Fixtures for kernel tests: the interpreted-kernel report, produced once per session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evospec.kernels.dispatch import triton_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def interpreted() -> dict[str, str]:
    """Case name -> "ok" or the failure, from ``tests.kernels.interp_cases`` run under
    ``TRITON_INTERPRET=1`` in a fresh interpreter (Triton reads the switch at import)."""
    if not triton_available():
        pytest.skip("triton does not import here")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("EVOSPEC_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.interp_cases"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

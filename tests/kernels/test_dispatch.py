"""Backend choice: torch on a CPU, the interpreter only when asked, forced backends checked."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels import dispatch
from evospec.kernels.dispatch import LazyKernel, interpreter_ready, pick_backend


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(dispatch.FORCE_ENV, raising=False)
    return monkeypatch


def test_cpu_tensors_use_torch_by_default(clean_env: pytest.MonkeyPatch) -> None:
    assert pick_backend("cpu") == "torch"
    assert pick_backend(torch.device("cpu"), force="torch") == "torch"


def test_interpret_switch_and_forcing(clean_env: pytest.MonkeyPatch) -> None:
    if not dispatch.triton_available():
        pytest.skip("triton does not import here")
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert pick_backend("cpu") == "interpret"
    clean_env.setenv(dispatch.FORCE_ENV, "torch")
    assert pick_backend("cpu") == "torch"  # the project's switch wins over Triton's
    clean_env.delenv("TRITON_INTERPRET")
    clean_env.setenv(dispatch.FORCE_ENV, "interpret")
    assert pick_backend("cpu") == "interpret"
    with pytest.raises(RuntimeError):
        pick_backend("cpu", force="triton")  # compiled Triton needs CUDA tensors
    with pytest.raises(ValueError):
        pick_backend("cpu", force="cuda-please")


def test_without_triton_auto_falls_back_and_forced_fails(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(dispatch, "triton_available", lambda: False)
    clean_env.setenv("TRITON_INTERPRET", "1")
    assert pick_backend("cpu") == "torch"
    with pytest.raises(RuntimeError):
        pick_backend("cpu", force="interpret")


def test_lazy_kernel_refuses_the_interpreter_when_triton_was_imported_without_it() -> None:
    if not dispatch.triton_available():
        pytest.skip("triton does not import here")
    kernel = LazyKernel(lambda x: None)
    with pytest.raises(ValueError):
        kernel.get("torch")
    if not interpreter_ready():  # this process imported triton without TRITON_INTERPRET
        with pytest.raises(RuntimeError):
            kernel.get("interpret")


def test_a_cpu_process_never_imports_triton() -> None:
    """Importing triton costs ~65 MB resident and ~0.13 s: the decoding stack's modules and their
    kernels' CPU paths leave it alone (a fresh interpreter: this one may have imported it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "import evospec.assembly, evospec.vocab.head, service.app\n"
        "from evospec.kernels.gather import gather_rows\n"
        "from evospec.kernels.window import window_push\n"
        "w, buf = torch.randn(8, 4), torch.zeros(3, 4)\n"
        "gather_rows(w, buf, torch.tensor([5, -1]), torch.tensor([0, 1]))\n"
        "ring, counts = torch.full((4,), -1), torch.zeros(8, dtype=torch.int32)\n"
        "window_push(ring, counts, torch.zeros(1, dtype=torch.long), torch.tensor([1, 2]))\n"
        "assert torch.equal(buf[0], w[5])\n"
        "print('triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", dispatch.FORCE_ENV)}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

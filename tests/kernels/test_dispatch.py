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

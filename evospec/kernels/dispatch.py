"""Which implementation a kernel call runs: compiled Triton, the Triton interpreter, or torch.

Owns: the backend decision and the lazy wrapping of plain kernel functions into Triton
kernels. Knows nothing about what the kernels compute.

- ``triton``: tensors on CUDA and ``triton`` importable -- the compiled kernel.
- ``interpret``: ``TRITON_INTERPRET=1`` in the environment (any device) -- the same kernel
  source run by Triton's CPU interpreter; slow, for correctness tests only.
- ``torch``: everything else (CPU runs, machines without Triton) -- the torch reference.

``EVOSPEC_KERNELS=torch|triton|interpret`` forces a backend (``auto``, the default, decides as
above). Triton reads ``TRITON_INTERPRET`` when it is imported (its own ``tl.sum``, ``tl.zeros``
... are decorated then) and when a kernel is decorated, so the interpreter works only in a
process that had the variable set before importing ``triton``: tests run it in a subprocess.
Kernels are decorated lazily, at their first launch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal

import torch

Backend = Literal["triton", "interpret", "torch"]
BACKENDS: tuple[Backend, ...] = ("triton", "interpret", "torch")
FORCE_ENV = "EVOSPEC_KERNELS"


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` and ``triton.language`` import (they do not on every platform)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpret_requested() -> bool:
    """``TRITON_INTERPRET`` is set to a true value (Triton's own spelling of the switch)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def pick_backend(device: torch.device | str, force: str | None = None) -> Backend:
    """The backend for tensors on ``device``; ``force`` (or ``$EVOSPEC_KERNELS``) overrides.

    Raises ``RuntimeError`` when a forced Triton backend cannot run here.
    """
    device = torch.device(device)
    choice = (force or os.environ.get(FORCE_ENV, "auto")).strip().lower()
    if choice == "torch":
        return "torch"
    if choice not in ("auto", "triton", "interpret"):
        raise ValueError(f"unknown kernel backend {choice!r}; use auto, {', '.join(BACKENDS)}")
    if choice == "auto" and device.type != "cuda" and not interpret_requested():
        return "torch"  # without importing triton (~65 MB, ~0.13 s a CPU process need not pay)
    if not triton_available():
        if choice != "auto":
            raise RuntimeError(f"kernel backend {choice!r} needs triton, which does not import here")
        return "torch"
    if choice == "interpret" or (choice == "auto" and interpret_requested()):
        return "interpret"
    if device.type == "cuda":
        return "triton"
    if choice == "triton":
        raise RuntimeError(f"the compiled Triton backend needs CUDA tensors, got {device}")
    return "torch"


def interpreter_ready() -> bool:
    """Triton was imported with ``TRITON_INTERPRET`` set, so its language library is interpretable."""
    if not triton_available():
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


class LazyKernel:
    """A plain kernel function, decorated with ``triton.jit`` at its first launch.

    ``kernel.get(backend)[grid](*args)`` launches it. Under ``TRITON_INTERPRET=1`` (set before
    ``triton`` was imported) the decorated kernel is Triton's interpreted one.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._kernel: Any = None

    def get(self, backend: Backend) -> Any:
        if backend == "torch":
            raise ValueError(f"{self.fn.__name__} has no torch backend; call the reference instead")
        if (backend == "interpret") != interpreter_ready():
            raise RuntimeError(
                f"kernel backend {backend!r} in a process where TRITON_INTERPRET was "
                f"{'unset' if backend == 'interpret' else 'set'} when triton was imported"
            )
        if self._kernel is None:
            import triton

            self._kernel = triton.jit(self.fn)
        return self._kernel

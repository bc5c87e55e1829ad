"""Small helpers every layer shares: where things live, and argument types.

Owns: the default shared-data folder (next to a checkout; a user's install has none), the
``$EVOSPEC_HOME`` cache root, the key naming the hardware a cached timing belongs to, the
whole-file replacement those caches are written with, ``positive_int`` for command-line flags,
the check of an output path before a command works towards it (``check_output``), safetensors
files written with the permissions of any other file (``save_tensors``), and SIGTERM turned into
a clean exit for long-running commands. Imports nothing of the project, so any module may import
it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def evospec_home() -> Path:
    """The cache root: ``$EVOSPEC_HOME``, else ``~/.cache/evospec``."""
    return Path(os.environ.get("EVOSPEC_HOME", Path.home() / ".cache" / "evospec")).expanduser()


def machine_key() -> str:
    """The hardware a timing belongs to: the GPU's name, or the CPU model and thread count."""
    import torch

    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name()}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu:{cpu}:{torch.get_num_threads()}t"


def replace_json(path: Path, obj: object) -> None:
    """Write ``obj`` to ``path`` as JSON, replacing the file whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``): loading a model
    frees the float copies of the weights it quantises, and glibc keeps freed memory for the
    process unless told (SmolLM2 int4: ~125 MB of a ~750 MB process). True where it gave some
    back; False where none was free, or where there is no glibc (the memory then stays with the
    process, as before)."""
    import ctypes
    import gc

    gc.collect()  # tensors held only by reference cycles first
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def stop_cleanly_on_sigterm() -> None:
    """Turn SIGTERM (and SIGINT where a background shell ignores it) into ``SystemExit(128 +
    signal)`` in the main thread, so ``finally`` blocks run: a training job keeps what it
    finished, a server saves its restart state. (Python's default SIGTERM ends the process at
    once; uvicorn, after its graceful shutdown, re-raises the signal it caught under the handler
    that was there before it, this one.) Elsewhere than the main thread: nothing."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, stop)


def check_output(path: str | Path | None, flag: str, *, folder: bool = False) -> None:
    """ValueError naming ``flag`` where a command could not write ``path`` (a file, or with
    ``folder`` a folder, created with its missing parents): it is a folder where a file is meant
    (or a file where a folder is), or a parent on its way is a file. Checked before the work, so
    that a benchmark or a training run does not end in a traceback with its results unwritten."""
    if path is None:
        return
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise ValueError(f"{flag} {path} is {'a file, not a folder' if folder else 'a folder; name a file'}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")
            return


def save_tensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, and the file readable as any other this process writes:
    safetensors 0.8 creates its files ``0600`` whatever the umask, so a head, an n-gram table or a
    converted model written by one user (a Docker build, a setup script) could not be read by
    the server running as another; here it gets ``0666`` less the umask, as ``open`` gives."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

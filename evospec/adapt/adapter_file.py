"""The adapter file: one key's online-adapter state on disk, written and validated here.

Owns: the file format (what :meth:`OnlineAdapter.save` writes and :meth:`OnlineAdapter.load`
accepts) and every check a file must pass before it is installed. Knows nothing about trainers,
replay buffers, keys or publication: it moves named tensors and metadata between a file and
its caller.

What the file holds: a safetensors file whose tensors are the trainer's adapter tensors
(``clora``: ``<layer>.lora_A.weight`` / ``<layer>.lora_B.weight`` of each adapted q/v
projection; ``osd``: every head parameter the adapter overwrites), stored contiguous on the
CPU, and a metadata header (safetensors allows strings only):

- ``format``: ``"evospec-adapter/1"`` (:data:`FORMAT`);
- ``mode``: the adapt mode that trained it (``clora`` | ``osd``);
- ``rank``, ``alpha``: the LoRA settings (written for both modes, checked for ``clora``);
- ``version``: the key's published version when saved (informative; a load installs the
  tensors as the key's next version);
- ``head``: JSON of the draft head's shape signature (hidden, vocab, heads, kv_heads).

Versioning: the format string names the layout; a change that old readers would misread bumps
its number, and a reader accepts its own format only.

What validation rejects (in this order): a missing path (``FileNotFoundError``); bytes that
are not readable safetensors; another ``format``; another ``mode``; for ``clora``, another
``rank`` or ``alpha``; a head signature that differs from the serving head's (all
``ValueError``, each message starting with the file's path or the name the caller gave).
Tensor names and shapes are checked by the trainer that installs them
(``load_adapter_tensors``).

Two levels: :func:`adapter_bytes` / :func:`parse_adapter` turn tensors into a file's bytes and
back (the admin API reads and writes those bytes itself, confined to its adapter folder: see
``evospec/files.py``); :func:`write_adapter` / :func:`read_adapter` do the same at a path the
(trusted) caller chose, the write atomic (temp file, fsync, rename).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evospec.adapt.config import AdaptConfig
from evospec.files import open_folder, write_atomic
from evospec.models.eagle import EagleHead

FORMAT = "evospec-adapter/1"


def head_signature(head: EagleHead) -> dict:
    """The shape of a draft head an adapter file was saved for."""
    c = head.cfg
    return {"hidden": c.hidden_size, "vocab": c.vocab_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads}


def adapter_metadata(cfg: AdaptConfig, head: EagleHead, version: int) -> dict[str, str]:
    """The header written with an adapter trained under ``cfg`` for ``head`` (strings only)."""
    return {
        "format": FORMAT,
        "mode": cfg.mode,
        "rank": str(cfg.rank),
        "alpha": str(cfg.lora_alpha),
        "version": str(version),
        "head": json.dumps(head_signature(head)),
    }


def check_metadata(meta: dict[str, str], cfg: AdaptConfig, head: EagleHead, source: str) -> None:
    """ValueError (starting with ``source``) unless ``meta`` describes an adapter that fits
    the configured ``cfg`` and the serving ``head``."""
    if meta.get("format") != FORMAT:
        raise ValueError(f"{source}: not an EvoSpec adapter (format {meta.get('format')!r})")
    if meta.get("mode") != cfg.mode:
        raise ValueError(f"{source}: a {meta.get('mode')} adapter cannot load into a {cfg.mode} adapter")
    try:
        rank, alpha = int(meta.get("rank", -1)), float(meta.get("alpha", -1))
        saved_head = json.loads(meta.get("head", "{}"))
    except (TypeError, ValueError):
        raise ValueError(f"{source}: unreadable adapter metadata") from None
    if cfg.mode == "clora" and (rank != cfg.rank or alpha != cfg.lora_alpha):
        raise ValueError(
            f"{source}: LoRA rank/alpha {meta.get('rank')}/{meta.get('alpha')} != "
            f"configured {cfg.rank}/{cfg.lora_alpha}"
        )
    if saved_head != head_signature(head):
        raise ValueError(f"{source}: saved for a different draft head")


def adapter_bytes(tensors: dict[str, torch.Tensor], cfg: AdaptConfig, head: EagleHead, version: int) -> bytes:
    """The file that holds ``tensors`` (the trainer's adapter tensors) with the metadata of
    ``cfg`` and ``head``, as bytes."""
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return save(tensors, metadata=adapter_metadata(cfg, head, version))


def safetensors_metadata(data: bytes | memoryview) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (ValueError when the header is unreadable)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("header runs past the end")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("header is not JSON") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def parse_adapter(data: bytes, cfg: AdaptConfig, head: EagleHead, source: str) -> dict[str, torch.Tensor]:
    """The tensors (on the CPU) of an adapter file's bytes, once validated against the
    configured ``cfg`` and the serving ``head``; ``source`` names the file in messages."""
    from safetensors.torch import load

    try:
        meta = safetensors_metadata(data)
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error type for a corrupt file
        raise ValueError(f"{source}: not a readable safetensors file ({exc})") from None
    check_metadata(meta, cfg, head, source)
    return tensors


def write_adapter(
    path: str | Path, tensors: dict[str, torch.Tensor], cfg: AdaptConfig, head: EagleHead, version: int
) -> Path:
    """Write ``tensors`` (the trainer's adapter tensors) with the metadata of ``cfg`` and ``head``
    to ``path``, atomically; the parent folders are created. Returns the path written."""
    path = Path(path)
    with open_folder(path.parent, create=True) as folder:
        write_atomic(folder, path.name, adapter_bytes(tensors, cfg, head, version))
    return path


def read_adapter(path: str | Path, cfg: AdaptConfig, head: EagleHead) -> dict[str, torch.Tensor]:
    """The tensors of the adapter file at ``path`` (on the CPU), once it is validated against the
    configured ``cfg`` and the serving ``head``; raises as the module docstring lists."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: adapter file not found")
    return parse_adapter(path.read_bytes(), cfg, head, str(path))

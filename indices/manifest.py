"""The manifest that binds an index directory to the model it was built from, and its loader.

Owns: the ``manifest.json`` format (``Manifest``), the model fingerprint, and
``load_indices``, which refuses -- with ``IndexLoadError`` naming the file, the problem and
the command that rebuilds it -- a directory whose manifest is missing or unreadable, whose
model (vocabulary size, hidden size, fingerprint) is not the served one, or whose files are
missing, truncated or altered (size and sha256 of every file, checked on each load).

Directory layout: ``manifest.json`` (written last) + the files it lists
(``frequency.npy``, ``bigram.npz``, ``hnsw.bin``) and the optional ones a policy reads when
they are listed (:data:`OPTIONAL_FILES`: the vocabtrim table, the vocabulary clusters, the
DynaSpec router, the SpecVocab selector), each added by :func:`add_index_file`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from indices.bigram import BigramGraph, BigramParams
from indices.frequency import load_counts
from indices.hnsw import HnswParams, LMHeadIndex

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
FREQUENCY_FILE = "frequency.npy"
BIGRAM_FILE = "bigram.npz"
HNSW_FILE = "hnsw.bin"
VOCABTRIM_FILE = "vocabtrim.npy"  # optional: counts of the target's own answers (the vocabtrim policy)
CLUSTERS_FILE = "clusters.npy"  # optional: [V] int16 vocabulary cluster of each id (indices/clusters.py)
DYNASPEC_FILE = "dynaspec.safetensors"  # optional: the DynaSpec cluster router (evospec/vocab/router.py)
SPECVOCAB_FILE = "specvocab.safetensors"  # optional: the SpecVocab low-rank selector (vocab/selector.py)
OPTIONAL_FILES = (VOCABTRIM_FILE, CLUSTERS_FILE, DYNASPEC_FILE, SPECVOCAB_FILE)
FINGERPRINT_STRIDE = 61  # rows hashed: 0, 61, 122, ... and the last


class IndexLoadError(ValueError):
    """An index directory cannot serve this model; the message names the path, the problem and
    how to rebuild. ``kind`` is one of: missing, unreadable, model_mismatch, corrupt, no_hnsw."""

    def __init__(self, path: Path, problem: str, kind: str, rebuild_hint: str) -> None:
        self.path = path
        self.problem = problem
        self.kind = kind
        super().__init__(f"{path}: {problem}. {rebuild_hint}")


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int  # bytes


@dataclass(frozen=True)
class SourceInfo:
    """One part of a corpus counted source by source (a training-side set, or corpus files)."""

    name: str  # a key of indices.corpus.TRAINING_SOURCES, or "corpus files"
    license: str  # "" when not known (a user's files)
    origin: str  # shared-data folder and upstream commit, or the paths
    num_documents: int
    num_tokens: int


@dataclass(frozen=True)
class CorpusInfo:
    description: str  # e.g. "training-side sets of /work/shared/data" or the corpus paths
    num_documents: int
    num_tokens: int
    sources: tuple[SourceInfo, ...] = ()  # per part, when counted part by part
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)  # training source -> why not used
    command: str = ""  # the command that rebuilds the counts, when recorded

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CorpusInfo:
        sources = tuple(SourceInfo(**s) for s in d.get("sources", ()))
        return cls(**{**d, "sources": sources, "left_out": dict(d.get("left_out", {}))})


@dataclass(frozen=True)
class HnswInfo:
    params: HnswParams
    max_norm: float  # M of the norm augmentation (largest row norm after centring, if centred)


@dataclass(frozen=True)
class Manifest:
    model_name: str
    model_source: str  # what --model was given (registered name, folder or .gguf path)
    model_fingerprint: str
    vocab_size: int
    hidden_size: int
    corpus: CorpusInfo
    bigram: BigramParams
    num_edges: int  # edges of the pruned bigram graph
    hnsw: HnswInfo | None  # None: built with --no-hnsw
    files: dict[str, FileEntry]  # file name (relative to the directory) -> checksum and size
    build_seconds: dict[str, float]  # part ("tokenize+count", "bigram", "hnsw", ...) -> seconds
    created: str  # ISO 8601 UTC
    format_version: int = FORMAT_VERSION
    # the vocabtrim table's source (indices/vocabtrim.py: sequences, tokens, origin, command); None: none
    vocabtrim: dict[str, Any] | None = None
    # what each other optional file was made from and by which command (file name -> record)
    extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        hnsw = d.get("hnsw")
        return cls(
            model_name=d["model_name"],
            model_source=d["model_source"],
            model_fingerprint=d["model_fingerprint"],
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            corpus=CorpusInfo.from_dict(d["corpus"]),
            bigram=BigramParams(**d["bigram"]),
            num_edges=int(d["num_edges"]),
            hnsw=None if hnsw is None else HnswInfo(HnswParams(**hnsw["params"]), float(hnsw["max_norm"])),
            files={name: FileEntry(**entry) for name, entry in d["files"].items()},
            build_seconds={k: float(v) for k, v in d["build_seconds"].items()},
            created=d["created"],
            format_version=int(d["format_version"]),
            vocabtrim=d.get("vocabtrim"),
            extras={k: dict(v) for k, v in d.get("extras", {}).items()},
        )


@dataclass(frozen=True)
class TrainedFile:
    """A small trained model stored with the indices: its tensors and string metadata."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def check(self, kind: str, fingerprint: str, retrain: str) -> dict[str, str]:
        """Its metadata, if it holds a ``kind`` trained for the LM head with this fingerprint;
        else ``ValueError`` naming the mismatch and the ``retrain`` command."""
        if self.metadata.get("kind") != kind:
            raise ValueError(f"the file is not a {kind} (its kind: {self.metadata.get('kind')!r})")
        if self.metadata.get("model_fingerprint") != fingerprint:
            raise ValueError(
                f"the {kind} was trained for another model (LM-head fingerprint differs); "
                f"retrain it: {retrain}"
            )
        return self.metadata


@dataclass
class IndexBundle:
    manifest: Manifest
    counts: np.ndarray  # [V] int64 token frequencies
    graph: BigramGraph
    hnsw: LMHeadIndex | None  # None when not requested (need_hnsw=False) or not built
    directory: Path  # where it was loaded from
    vocabtrim: np.ndarray | None = None  # [V] int64 counts of the target's own answers, if built
    clusters: np.ndarray | None = None  # [V] int64 vocabulary cluster of each id, if built
    dynaspec: TrainedFile | None = None  # the DynaSpec router, if trained
    specvocab: TrainedFile | None = None  # the SpecVocab selector, if trained


def model_fingerprint(lm_head_weight: torch.Tensor) -> str:
    """sha256 over the shape and a strided subset of LM-head rows (every 61st and the last).

    Values are rounded to bfloat16 first, so one checkpoint served in fp32 or bf16 has one
    fingerprint (an fp16 copy may differ: fp32 -> fp16 -> bf16 can round differently).
    """
    w = lm_head_weight.detach()
    rows = torch.cat([w[::FINGERPRINT_STRIDE], w[-1:]])  # [ceil(V / 61) + 1, D]
    rows = rows.to(device="cpu", dtype=torch.bfloat16).to(torch.float32).contiguous()
    h = hashlib.sha256()
    h.update(("x".join(str(s) for s in w.shape)).encode())
    h.update(rows.numpy().tobytes())
    return h.hexdigest()


def file_entry(path: Path) -> FileEntry:
    return FileEntry(sha256=_sha256(path), size=path.stat().st_size)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (temp file, then rename)."""
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(manifest.to_json())
    os.replace(tmp, directory / MANIFEST_NAME)


def rebuild_hint(directory: Path, model_source: str | None = None) -> str:
    model = model_source or "MODEL"
    return (
        f"Rebuild it with: evospec-index build --model {model} --corpus FILES... --out {directory} "
        "(or --training-data [DIR] from a checkout's shared data; see evospec-index build --help)"
    )


def read_manifest(directory: Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not path.is_file():
        why = (
            "no such directory"
            if not directory.is_dir()
            else f"no {MANIFEST_NAME} (not built, or interrupted)"
        )
        raise IndexLoadError(directory, why, "missing", rebuild_hint(directory))
    try:
        raw = json.loads(path.read_text())
        manifest = Manifest.from_dict(raw)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise IndexLoadError(
            path, f"unreadable manifest ({exc!r})", "unreadable", rebuild_hint(directory)
        ) from exc
    if manifest.format_version != FORMAT_VERSION:
        raise IndexLoadError(
            path,
            f"format version {manifest.format_version}, this code reads {FORMAT_VERSION}",
            "unreadable",
            rebuild_hint(directory, manifest.model_source),
        )
    return manifest


def check_model(directory: Path, manifest: Manifest, lm_head_weight: torch.Tensor) -> None:
    """Raise ``IndexLoadError`` unless the manifest was built from this LM head."""
    hint = rebuild_hint(directory, manifest.model_source)
    vocab, hidden = lm_head_weight.shape
    path = directory / MANIFEST_NAME
    if manifest.vocab_size != vocab or manifest.hidden_size != hidden:
        raise IndexLoadError(
            path,
            f"built for vocab {manifest.vocab_size} x hidden {manifest.hidden_size} "
            f"({manifest.model_name}), the served model has {vocab} x {hidden}",
            "model_mismatch",
            hint,
        )
    fingerprint = model_fingerprint(lm_head_weight)
    if manifest.model_fingerprint != fingerprint:
        raise IndexLoadError(
            path,
            f"built for another model (fingerprint {manifest.model_fingerprint[:12]}... of "
            f"{manifest.model_name}, the served LM head has {fingerprint[:12]}...)",
            "model_mismatch",
            hint,
        )


def check_files(directory: Path, manifest: Manifest, names: list[str]) -> None:
    """Raise ``IndexLoadError`` unless each of ``names`` exists with its listed size and sha256."""
    hint = rebuild_hint(directory, manifest.model_source)
    for name in names:
        entry = manifest.files.get(name)
        path = directory / name
        if entry is None:
            raise IndexLoadError(path, f"not listed in {MANIFEST_NAME}", "unreadable", hint)
        if not path.is_file():
            raise IndexLoadError(path, f"file missing (listed in {MANIFEST_NAME})", "corrupt", hint)
        size = path.stat().st_size
        if size != entry.size:
            raise IndexLoadError(
                path, f"size {size} bytes, expected {entry.size} (truncated?)", "corrupt", hint
            )
        if _sha256(path) != entry.sha256:
            raise IndexLoadError(path, "sha256 mismatch (file altered or corrupt)", "corrupt", hint)


def load_indices(directory: Path, lm_head_weight: torch.Tensor, *, need_hnsw: bool = True) -> IndexBundle:
    """Read and verify the indices in ``directory`` for the model whose LM head is ``lm_head_weight``
    ([V, D]). With ``need_hnsw=False`` the HNSW file is neither checked nor loaded. The optional
    files are loaded when the manifest lists them."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_model(directory, manifest, lm_head_weight)
    hint = rebuild_hint(directory, manifest.model_source)
    if need_hnsw and manifest.hnsw is None:
        raise IndexLoadError(directory, "built without the HNSW index (--no-hnsw)", "no_hnsw", hint)
    optional = [f for f in OPTIONAL_FILES if f in manifest.files]
    check_files(
        directory, manifest, [FREQUENCY_FILE, BIGRAM_FILE, *([HNSW_FILE] if need_hnsw else []), *optional]
    )
    try:
        counts = load_counts(directory / FREQUENCY_FILE)
        graph = BigramGraph.load(directory / BIGRAM_FILE)
        hnsw = None
        if need_hnsw and manifest.hnsw is not None:
            hnsw = LMHeadIndex.load(directory / HNSW_FILE, manifest.hidden_size, ef=manifest.hnsw.params.ef)
        extra = {f: load_optional_file(directory / f) for f in optional}
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # checksum ok but unreadable
        raise IndexLoadError(directory, f"cannot read index files ({exc!r})", "unreadable", hint) from exc
    trimmed, clusters = extra.get(VOCABTRIM_FILE), extra.get(CLUSTERS_FILE)
    sizes = {counts.size, graph.vocab_size} | {t.size for t in (trimmed, clusters) if t is not None}
    if sizes != {manifest.vocab_size}:
        raise IndexLoadError(
            directory, "index files disagree with the manifest's vocab size", "corrupt", hint
        )
    return IndexBundle(
        manifest,
        counts,
        graph,
        hnsw,
        directory,
        trimmed,
        None if clusters is None else clusters.astype(np.int64),
        extra.get(DYNASPEC_FILE),
        extra.get(SPECVOCAB_FILE),
    )


def load_optional_file(path: Path) -> np.ndarray | TrainedFile:
    """An optional index file: a table (.npy) or a trained model's tensors and metadata."""
    if path.suffix == ".npy":
        return load_counts(path) if path.name == VOCABTRIM_FILE else np.load(path, allow_pickle=False)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return TrainedFile({k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {}))  # noqa: SIM118


def add_index_file(
    directory: Path,
    lm_head_weight: torch.Tensor,
    name: str,
    write: Callable[[Path], None],
    record: dict[str, Any],
    *,
    seconds: float = 0.0,
) -> Manifest:
    """Add (or replace) the optional file ``name`` of an index directory built for this model:
    ``write(tmp)`` writes it, it is moved in place, then the manifest listing it and ``record``
    (what it was made from; the vocabtrim table's goes to ``Manifest.vocabtrim``) is written."""
    if name not in OPTIONAL_FILES:
        raise ValueError(f"{name}: not an optional index file ({', '.join(OPTIONAL_FILES)})")
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_model(directory, manifest, lm_head_weight)
    tmp = directory / f".{name}.tmp{Path(name).suffix}"
    try:
        write(tmp)
        tmp.chmod(0o644)  # like the other index files, whatever the writer's default
        tmp.replace(directory / name)
    finally:
        tmp.unlink(missing_ok=True)
    files = {**manifest.files, name: file_entry(directory / name)}
    built = {**manifest.build_seconds, Path(name).stem: round(seconds, 3)}
    if name == VOCABTRIM_FILE:
        manifest = replace(manifest, files=files, build_seconds=built, vocabtrim=record)
    else:
        manifest = replace(
            manifest, files=files, build_seconds=built, extras={**manifest.extras, name: record}
        )
    write_manifest(directory, manifest)
    return manifest

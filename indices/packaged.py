"""Index tables shipped inside the package, so a fresh install serves every vocabulary method.

Owns: where they live (``indices/packaged/<model name>/``: ``manifest.json``, ``frequency.npy``,
``bigram.npz``, ``NOTICE``), finding the ones for a served model (:func:`packaged_for`),
verifying them (:func:`read_packaged`: size and sha256 of every listed file), installing them
into a model's index directory (:func:`install_packaged`), and rebuilding them from the
redistributable training-side sets of the shared data (:func:`build_packaged`, the
``evospec-index package`` command).

What ships is counts, never text: the token-frequency table and the pruned bigram graph depend
on the tokenizer and the corpus only. The HNSW index depends on the model only (its LM-head
rows); it is 127 MB for the default model, so it is built on first use into the index directory
(``build.add_hnsw``), not shipped. Only sets whose licenses allow redistribution are counted
(``indices.corpus.REDISTRIBUTABLE``); the manifest lists each with its license, upstream,
commit and counts, and the sets left out with the reason.

Does not know where a model's index directory is (``default.py``) or how counting works
(``build.py``).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from evospec.tokenizer import TextCodec
from indices.bigram import BigramGraph
from indices.build import CorpusPart, build_from_texts, check_replaceable, replace_dir
from indices.corpus import REDISTRIBUTABLE, TRAINING_SOURCES, source_commit, training_texts
from indices.frequency import load_counts
from indices.manifest import (
    BIGRAM_FILE,
    FREQUENCY_FILE,
    MANIFEST_NAME,
    OPTIONAL_FILES,
    IndexLoadError,
    Manifest,
    check_files,
    model_fingerprint,
    read_manifest,
    write_manifest,
)

PACKAGED_ROOT = Path(__file__).resolve().parent / "packaged"
PACKAGED_FILES = (FREQUENCY_FILE, BIGRAM_FILE)  # what ships per model (with manifest.json, NOTICE)
# OPTIONAL_FILES (vocabtrim table, clusters, DynaSpec router, SpecVocab selector) ship where the
# manifest lists them
NOTICE_FILE = "NOTICE"


@dataclass
class PackagedTables:
    manifest: Manifest
    counts: np.ndarray  # [V] int64 token frequencies
    graph: BigramGraph
    directory: Path


def packaged_dirs(root: Path | None = None) -> list[Path]:
    """Every packaged table folder (one per model), by name."""
    root = PACKAGED_ROOT if root is None else Path(root)
    return sorted(d for d in root.glob("*") if (d / MANIFEST_NAME).is_file()) if root.is_dir() else []


def packaged_for(model_name: str, lm_head_weight: torch.Tensor, root: Path | None = None) -> Path | None:
    """The packaged tables of a served model: the folder built for ``model_name``, or for an LM
    head with this fingerprint (the same model under another name), with the same vocabulary."""
    vocab = lm_head_weight.shape[0]
    fingerprint = None
    for d in packaged_dirs(root):
        m = read_manifest(d)
        if m.vocab_size != vocab:
            continue
        if m.model_name == model_name:
            return d
        fingerprint = fingerprint or model_fingerprint(lm_head_weight)
        if m.model_fingerprint == fingerprint:
            return d
    return None


def read_packaged(directory: Path) -> PackagedTables:
    """The verified tables of a packaged folder (``IndexLoadError`` naming a bad file)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_files(directory, manifest, [*PACKAGED_FILES, *(f for f in OPTIONAL_FILES if f in manifest.files)])
    counts = load_counts(directory / FREQUENCY_FILE)
    graph = BigramGraph.load(directory / BIGRAM_FILE)
    if counts.size != manifest.vocab_size or graph.vocab_size != manifest.vocab_size:
        raise IndexLoadError(
            directory, "packaged tables disagree with their manifest's vocab size", "corrupt", _HINT
        )
    return PackagedTables(manifest, counts, graph, directory)


_HINT = "Rebuild them with: evospec-index package --training-data DIR (see docs/vocab.md)"


def install_packaged(
    source: Path, out_dir: Path, lm_head_weight: torch.Tensor, *, model_source: str | None = None
) -> Manifest:
    """Copy verified packaged tables into ``out_dir`` (replacing an older index directory there)
    as an index directory without HNSW, bound to the served LM head ([V, D]).

    The counts depend on the tokenizer only, so the manifest keeps their corpus and build facts
    and takes the served model's fingerprint and hidden size (one packaged folder serves the
    model in any dtype).
    """
    tables = read_packaged(source)
    vocab, hidden = lm_head_weight.shape
    if tables.manifest.vocab_size != vocab:
        raise IndexLoadError(
            source,
            f"packaged for vocab {tables.manifest.vocab_size}, the served model has {vocab}",
            "model_mismatch",
            _HINT,
        )
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-install-", dir=out_dir.parent))
    try:
        names = [*PACKAGED_FILES, *(f for f in OPTIONAL_FILES if f in tables.manifest.files)]
        for name in names:
            shutil.copyfile(Path(source) / name, work / name)
        manifest = replace(
            tables.manifest,
            model_source=model_source or tables.manifest.model_source,
            model_fingerprint=model_fingerprint(lm_head_weight),
            hidden_size=hidden,
            hnsw=None,
            files={name: tables.manifest.files[name] for name in names},
        )
        write_manifest(work, manifest)
        work.chmod(0o755)
        replace_dir(work, out_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return manifest


def build_packaged(
    lm_head_weight: torch.Tensor,
    codec: TextCodec,
    data_dir: Path,
    out_dir: Path,
    *,
    model_name: str,
    model_source: str | None = None,
    command: str = "",
    progress: bool = True,
) -> Manifest:
    """Count the redistributable training-side sets of ``data_dir`` into ``out_dir`` (frequency
    table and bigram graph, no HNSW), recording each set and the ones left out, and write the
    attribution ``NOTICE``."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: shared data folder not found")
    parts = [
        CorpusPart(
            name,
            training_texts(data_dir, [name]),
            TRAINING_SOURCES[name].license,
            _origin(data_dir, name),
        )
        for name in REDISTRIBUTABLE
    ]
    left_out = {
        name: f"{s.license}: {s.why}" for name, s in TRAINING_SOURCES.items() if not s.redistributable
    }
    manifest = build_from_texts(
        lm_head_weight,
        codec,
        parts,
        out_dir,
        progress=progress,
        model_name=model_name,
        model_source=model_source,
        corpus_description=f"redistributable training-side sets ({', '.join(REDISTRIBUTABLE)})",
        left_out=left_out,
        command=command
        or f"evospec-index package --model {model_source or model_name} --training-data {data_dir}",
        hnsw=False,
    )
    (Path(out_dir) / NOTICE_FILE).write_text(notice(manifest))
    return manifest


def _origin(data_dir: Path, name: str) -> str:
    s = TRAINING_SOURCES[name]
    commit = source_commit(data_dir, name)
    return f"{s.upstream}; shared/data/{s.folder}" + (f" @ {commit}" if commit else "")


def notice(manifest: Manifest) -> str:
    """The attribution text shipped beside the tables."""
    lines = [
        f"Index tables for {manifest.model_name}: token counts (frequency.npy) and a pruned bigram",
        "successor graph (bigram.npz) derived from the data sets below. They hold counts only,",
        "no text. Each set keeps its license; the counts were changed from the original by",
        "tokenizing, counting and pruning.",
        "",
    ]
    for s in manifest.corpus.sources:
        lines.append(f"- {s.name} ({s.num_documents} documents, {s.num_tokens} tokens)")
        lines.append(f"  from {s.origin}")
        lines.append(f"  license: {s.license}")
    lines += ["", "Left out (not redistributable in this form):"]
    lines += [f"- {name}: {why}" for name, why in manifest.corpus.left_out.items()]
    lines += ["", f"Rebuilt with: {manifest.corpus.command}", ""]
    return "\n".join(lines)

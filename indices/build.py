"""Offline build of an index directory: frequency table + bigram graph + HNSW + manifest.

Owns: tokenizing documents in batches (with a progress bar), one streaming pass over the
token sequences feeding both counters, writing the files into a temporary sibling directory
and renaming it into place (an interrupted build leaves the old directory untouched), and
adding a missing HNSW index to an existing directory.

Does not know where corpora or models live (``corpus.py``, ``default.py`` and the CLI do).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from evospec.tokenizer import TextCodec
from indices.bigram import BigramGraph, BigramParams, PairCounter
from indices.frequency import TokenCounter, save_counts
from indices.hnsw import HnswParams, LMHeadIndex
from indices.manifest import (
    BIGRAM_FILE,
    FREQUENCY_FILE,
    HNSW_FILE,
    MANIFEST_NAME,
    CorpusInfo,
    HnswInfo,
    Manifest,
    SourceInfo,
    check_model,
    file_entry,
    model_fingerprint,
    read_manifest,
    write_manifest,
)

TOKENIZE_BATCH = 256  # documents per encode_batch call


def tokenize_texts(
    texts: Iterable[str],
    codec: TextCodec,
    *,
    batch_size: int = TOKENIZE_BATCH,
    max_tokens: int | None = None,
    progress: bool = True,
    desc: str = "tokenizing",
) -> Iterator[np.ndarray]:
    """Token ids ([n] int64) of each document, as ``codec.encode`` gives them, batch-encoded.

    Stops after ``max_tokens`` ids in all (the last document is cut short).
    """
    encode_batch = getattr(codec.tok, "encode_batch", None)
    total = 0
    with tqdm(desc=desc, unit="tok", unit_scale=True, disable=not progress) as bar:
        for batch in _batches(texts, batch_size):
            if encode_batch is not None:
                encoded = [e.ids for e in encode_batch(batch, add_special_tokens=True)]
            else:
                encoded = [codec.encode(t) for t in batch]
            for ids in encoded:
                seq = np.asarray(ids, dtype=np.int64)
                if max_tokens is not None:
                    seq = seq[: max_tokens - total]
                total += seq.size
                bar.update(seq.size)
                yield seq
                if max_tokens is not None and total >= max_tokens:
                    return


@dataclass
class CorpusPart:
    """A named part of a corpus (a training-side set, a user's files), counted on its own so
    the manifest can say what each part contributed and under which license."""

    name: str
    texts: Iterable[str]
    license: str = ""  # "" when not known
    origin: str = ""  # where the texts came from
    num_documents: int = 0  # filled in while the part is tokenized
    num_tokens: int = 0

    def info(self) -> SourceInfo:
        return SourceInfo(self.name, self.license, self.origin, self.num_documents, self.num_tokens)


def tokenize_parts(
    parts: Sequence[CorpusPart], codec: TextCodec, *, max_tokens: int | None = None, progress: bool = True
) -> Iterator[np.ndarray]:
    """``tokenize_texts`` over each part in turn (``max_tokens`` in all), tallying each part."""
    total = 0
    for part in parts:
        left = None if max_tokens is None else max_tokens - total
        if left is not None and left <= 0:
            return
        desc = f"tokenizing {part.name}" if part.name else "tokenizing"
        for seq in tokenize_texts(part.texts, codec, max_tokens=left, progress=progress, desc=desc):
            part.num_documents += int(seq.size > 0)
            part.num_tokens += seq.size
            total += seq.size
            yield seq


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def weight_array(lm_head_weight: torch.Tensor) -> np.ndarray:
    """[V, D] float32 CPU copy of an LM head (any dtype or device)."""
    return lm_head_weight.detach().to(device="cpu", dtype=torch.float32).numpy()


def build_indices(
    lm_head_weight: torch.Tensor,  # [V, D]
    token_seqs: Iterable[np.ndarray | Sequence[int]],  # documents as token ids; pairs never cross two
    out_dir: Path,
    *,
    model_name: str,
    model_source: str | None = None,
    corpus_description: str = "",
    parts: Sequence[CorpusPart] = (),  # recorded per part once token_seqs is consumed
    left_out: dict[str, str] | None = None,  # training sources deliberately not counted -> why
    command: str = "",  # the command that rebuilds this directory
    bigram_params: BigramParams | None = None,  # default: BigramParams()
    hnsw_params: HnswParams | None = None,  # default: HnswParams()
    hnsw: bool = True,
    hnsw_threads: int = -1,
    progress: bool = True,
) -> Manifest:
    """Count, prune, index and write ``out_dir`` (replacing an older index directory there)."""
    out_dir = Path(out_dir)
    bigram_params = bigram_params or BigramParams()
    hnsw_params = hnsw_params or HnswParams()
    check_replaceable(out_dir)
    vocab, hidden = lm_head_weight.shape
    seconds: dict[str, float] = {}
    t_start = time.perf_counter()
    tokens, pairs = TokenCounter(vocab), PairCounter(vocab)
    for seq in token_seqs:
        ids = np.asarray(seq, dtype=np.int64)
        tokens.add(ids)
        pairs.add(ids)
    counts = tokens.counts
    seconds["tokenize_and_count"] = time.perf_counter() - t_start

    t0 = time.perf_counter()
    graph = BigramGraph.from_counts(pairs.counts, bigram_params)
    seconds["bigram_prune"] = time.perf_counter() - t0

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-build-", dir=out_dir.parent))
    try:
        save_counts(work / FREQUENCY_FILE, counts)
        graph.save(work / BIGRAM_FILE)
        hnsw_info = None
        if hnsw:
            t0 = time.perf_counter()
            hnsw_info = _build_hnsw(lm_head_weight, work / HNSW_FILE, hnsw_params, hnsw_threads, progress)
            seconds["hnsw"] = time.perf_counter() - t0
        names = [FREQUENCY_FILE, BIGRAM_FILE] + ([HNSW_FILE] if hnsw else [])
        seconds["total"] = time.perf_counter() - t_start
        manifest = Manifest(
            model_name=model_name,
            model_source=model_source or model_name,
            model_fingerprint=model_fingerprint(lm_head_weight),
            vocab_size=vocab,
            hidden_size=hidden,
            corpus=CorpusInfo(
                corpus_description,
                tokens.num_sequences,
                tokens.num_tokens,
                sources=tuple(p.info() for p in parts),
                left_out=dict(left_out or {}),
                command=command,
            ),
            bigram=bigram_params,
            num_edges=graph.num_edges,
            hnsw=hnsw_info,
            files={name: file_entry(work / name) for name in names},
            build_seconds={k: round(v, 3) for k, v in seconds.items()},
            created=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        write_manifest(work, manifest)
        work.chmod(0o755)  # mkdtemp made it private; an index directory is ordinary data
        replace_dir(work, out_dir)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return manifest


def _build_hnsw(
    lm_head_weight: torch.Tensor, path: Path, params: HnswParams, threads: int, progress: bool
) -> HnswInfo:
    index, max_norm = LMHeadIndex.build(
        weight_array(lm_head_weight), params, num_threads=threads, progress=progress
    )
    index.save(path)
    return HnswInfo(params, max_norm)


def add_hnsw(
    directory: Path,
    lm_head_weight: torch.Tensor,
    hnsw_params: HnswParams | None = None,  # default: HnswParams()
    *,
    hnsw_threads: int = -1,
    progress: bool = True,
) -> Manifest:
    """Build (or rebuild) the HNSW index of an existing directory built for this model.

    The new file replaces ``hnsw.bin`` before the manifest naming it is written, so an
    interruption leaves a directory that still loads as before.
    """
    directory = Path(directory)
    hnsw_params = hnsw_params or HnswParams()
    manifest = read_manifest(directory)
    check_model(directory, manifest, lm_head_weight)
    t0 = time.perf_counter()
    tmp = directory / f".{HNSW_FILE}.tmp"
    try:
        info = _build_hnsw(lm_head_weight, tmp, hnsw_params, hnsw_threads, progress)
        tmp.replace(directory / HNSW_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = {**manifest.build_seconds, "hnsw": round(time.perf_counter() - t0, 3)}
    files = {**manifest.files, HNSW_FILE: file_entry(directory / HNSW_FILE)}
    manifest = replace(manifest, hnsw=info, files=files, build_seconds=seconds)
    write_manifest(directory, manifest)
    return manifest


def build_from_texts(
    lm_head_weight: torch.Tensor,
    codec: TextCodec,
    texts: Iterable[str] | Sequence[CorpusPart],
    out_dir: Path,
    *,
    max_tokens: int | None = None,
    progress: bool = True,
    **build_kwargs: Any,
) -> Manifest:
    """``build_indices`` over ``texts`` tokenized by ``codec`` (see ``build_indices`` for the rest).

    ``texts`` is one stream of documents, or a sequence of ``CorpusPart`` (each recorded in
    the manifest with its license and counts).
    """
    if codec.vocab_size > lm_head_weight.shape[0]:
        raise ValueError(
            f"tokenizer has {codec.vocab_size} ids but the LM head only {lm_head_weight.shape[0]} rows"
        )
    if isinstance(texts, Sequence) and texts and all(isinstance(p, CorpusPart) for p in texts):
        parts: Sequence[CorpusPart] = texts
        seqs = tokenize_parts(parts, codec, max_tokens=max_tokens, progress=progress)
        build_kwargs["parts"] = parts
    else:
        seqs = tokenize_texts(texts, codec, max_tokens=max_tokens, progress=progress)  # type: ignore[arg-type]
    return build_indices(lm_head_weight, seqs, out_dir, progress=progress, **build_kwargs)


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace a folder that is not an index directory (a typo must not delete data)."""
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file())
    ):
        raise ValueError(
            f"{out_dir}: exists and is not an index directory (no {MANIFEST_NAME}); "
            "refusing to replace it -- choose an empty or new --out"
        )


def replace_dir(new: Path, target: Path) -> None:
    if not target.exists():
        new.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
    old.rmdir()
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)

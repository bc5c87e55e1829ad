"""The index directory of a served model, made on first use.

Owns: where a model's indices live (``$EVOSPEC_HOME/indices/<model name>``, or
``<model name>+corpus-<digest>`` for indices counted from a user's corpus files) and
``ensure_indices``: load them if present and valid for the served model, else make them and
load the result. A missing or stale directory is made from, first match:

1. the user's ``corpus`` files, when given (a directory counted from other files is rebuilt);
2. the tables shipped in the package for the model (``packaged.py``: counts only, no shared
   data needed), with the HNSW index over the LM-head rows built here, once;
3. the training-side sets of the shared data folder next to a checkout;

else ``IndexLoadError`` says how to give a corpus. A valid directory that only lacks the HNSW
index gets just that part added (with a progress bar).

Does not know how indices are counted or verified (``build.py``, ``manifest.py`` do).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

from evospec.common import DEFAULT_DATA, evospec_home
from evospec.models.loading import LoadedModel
from evospec.models.registry import REGISTRY
from indices.build import CorpusPart, add_hnsw, build_from_texts
from indices.corpus import TRAINING_SOURCES, corpus_files, read_corpus_files, training_texts
from indices.manifest import (
    CLUSTERS_FILE,
    DYNASPEC_FILE,
    SPECVOCAB_FILE,
    VOCABTRIM_FILE,
    IndexBundle,
    IndexLoadError,
    load_indices,
    read_manifest,
)
from indices.packaged import install_packaged, packaged_for


def default_index_dir(model_name: str) -> Path:
    return evospec_home() / "indices" / model_name


def corpus_digest(files: Sequence[Path]) -> str:
    """12 hex digits naming a set of corpus files (resolved path, size, modification time)."""
    h = hashlib.sha256()
    for f in sorted(Path(f).resolve() for f in files):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def corpus_index_dir(model_name: str, files: Sequence[Path]) -> Path:
    return evospec_home() / "indices" / f"{model_name}+corpus-{corpus_digest(files)}"


def corpus_description(paths: Sequence[str | Path], files: Sequence[Path]) -> str:
    """What a manifest says of indices counted from ``paths`` (expanded into ``files``)."""
    named = ", ".join(str(Path(p).resolve()) for p in paths)
    return f"corpus files {named} ({len(files)} files, digest {corpus_digest(files)})"


def model_source(loaded: LoadedModel) -> str:
    """What ``load_model`` needs to load ``loaded`` again: its registered name, or its path."""
    return loaded.name if loaded.name in REGISTRY else str(loaded.source)


def ensure_indices(
    loaded_model: LoadedModel,
    *,
    data_dir: Path | None = None,
    directory: Path | None = None,
    corpus: Sequence[str | Path] | None = None,
    need_hnsw: bool = True,
    need_files: Collection[str] = (),
    progress: bool = True,
) -> IndexBundle:
    """The verified indices of ``loaded_model``, making what is missing or stale first (see the
    module docstring for what from).

    ``directory`` defaults to ``default_index_dir(loaded_model.name)`` (with ``corpus``:
    ``corpus_index_dir``); ``data_dir`` to the shared data folder next to the checkout;
    ``corpus``: .txt / .jsonl / .json files or folders (``indices.corpus.read_corpus_files``).
    ``need_files``: optional files a policy reads (``manifest.OPTIONAL_FILES``); missing ones are
    copied from the tables shipped for the model, the clusters built here, else an
    ``IndexLoadError`` names the command that makes them.
    """
    bundle = _ensure(loaded_model, data_dir, directory, corpus, need_hnsw, progress)
    missing = [f for f in need_files if f not in bundle.manifest.files]
    if missing:
        for name in missing:
            _add_optional(loaded_model, bundle, name, progress)
        bundle = load_indices(bundle.directory, loaded_model.model.lm_head.weight, need_hnsw=need_hnsw)
    return bundle


_MAKE_HINTS = {  # how a user makes an optional file that does not ship for their model
    VOCABTRIM_FILE: "Count the target's answers: evospec-index vocabtrim --model MODEL --generations "
    "$EVOSPEC_HOME/train/<model>/generations.jsonl (written by evospec train-draft)",
    DYNASPEC_FILE: "Train the DynaSpec router: evospec train-vocab dynaspec --model MODEL",
    SPECVOCAB_FILE: "Train the SpecVocab selector: evospec train-vocab specvocab --model MODEL",
}


def _add_optional(loaded_model: LoadedModel, bundle: IndexBundle, name: str, progress: bool) -> None:
    """Copy the optional file ``name`` shipped for the model into its index directory (the
    clusters, when none ship, are built here: a few seconds)."""
    from indices.manifest import add_index_file
    from indices.packaged import read_packaged

    weight = loaded_model.model.lm_head.weight
    packaged = packaged_for(loaded_model.name, weight)
    shipped = read_packaged(packaged) if packaged is not None else None
    if shipped is None or name not in shipped.manifest.files:
        if name == CLUSTERS_FILE:
            from indices.clusters import add_clusters

            _say(progress, f"{bundle.directory}: clustering the LM-head rows for dynaspec (once)")
            add_clusters(bundle.directory, weight)
            return
        raise IndexLoadError(
            bundle.directory / name, "missing, and none ships for this model", "missing", _MAKE_HINTS[name]
        )
    _say(progress, f"{bundle.directory}: adding the {name} shipped for {loaded_model.name}")
    m = shipped.manifest
    record = dict(m.vocabtrim or {}) if name == VOCABTRIM_FILE else dict(m.extras.get(name, {}))
    data = (packaged / name).read_bytes()
    add_index_file(bundle.directory, weight, name, lambda tmp: Path(tmp).write_bytes(data), record)


def _ensure(loaded_model, data_dir, directory, corpus, need_hnsw, progress) -> IndexBundle:
    weight = loaded_model.model.lm_head.weight  # [V, D]
    files = corpus_files(corpus) if corpus else []  # checked before anything is read or built
    wanted = corpus_description(corpus, files) if corpus else None  # type: ignore[arg-type]
    if directory is None:
        directory = (
            corpus_index_dir(loaded_model.name, files) if corpus else default_index_dir(loaded_model.name)
        )
    directory = Path(directory)
    try:
        bundle = load_indices(directory, weight, need_hnsw=need_hnsw)
        if wanted is None or bundle.manifest.corpus.description == wanted:
            return bundle
        problem = "counted from other corpus files"
    except IndexLoadError as exc:
        problem = exc.problem
        if exc.kind == "no_hnsw" and (
            wanted is None or read_manifest(directory).corpus.description == wanted
        ):
            _say(progress, f"{directory}: {problem}; building the HNSW index over the LM head (once)")
            add_hnsw(directory, weight, progress=progress)
            return load_indices(directory, weight, need_hnsw=need_hnsw)
    data = Path(data_dir) if data_dir is not None else DEFAULT_DATA
    packaged = None if corpus else packaged_for(loaded_model.name, weight)
    if packaged is not None:
        _say(progress, f"{directory}: {problem}; installing the tables shipped for {loaded_model.name}")
        install_packaged(packaged, directory, weight, model_source=model_source(loaded_model))
        if need_hnsw:
            _say(progress, f"{directory}: building the HNSW index over the LM head (once)")
            add_hnsw(directory, weight, progress=progress)
        return load_indices(directory, weight, need_hnsw=need_hnsw)
    if not corpus and not data.is_dir():
        raise IndexLoadError(
            directory,
            f"{problem}; no index tables ship for {loaded_model.name} and there is no shared data "
            f"folder at {data} to count them from",
            "missing",
            "Count your own text: --corpus FILES (vocab.corpus in a serve config), or "
            f"evospec-index build --model {model_source(loaded_model)} --corpus FILES --out DIR "
            "and then --indices DIR",
        )
    if loaded_model.codec is None:
        raise IndexLoadError(
            directory,
            "cannot build indices: the model carries no tokenizer",
            "missing",
            "Build them with evospec-index build --model MODEL_WITH_TOKENIZER --out DIR",
        )
    _say(progress, f"{directory}: {problem}; building")
    if corpus:
        parts = [CorpusPart("corpus files", read_corpus_files(files), origin=", ".join(map(str, corpus)))]
        description = wanted
    else:
        parts = [
            CorpusPart(name, training_texts(data, [name]), s.license, f"{s.upstream}; {data / s.folder}")
            for name, s in TRAINING_SOURCES.items()
        ]
        description = f"training-side sets of {data}"
    build_from_texts(
        weight,
        loaded_model.codec,
        parts,
        directory,
        model_name=loaded_model.name,
        model_source=model_source(loaded_model),
        corpus_description=description,
        hnsw=need_hnsw,
        progress=progress,
    )
    return load_indices(directory, weight, need_hnsw=need_hnsw)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"[evospec-index] {text}", file=sys.stderr)

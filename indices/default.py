"""The default index directory of a model, built on first use.

Owns: where a model's indices live (``$EVOSPEC_HOME/indices/<model name>``) and
``ensure_indices``: load them if present and valid for the served model, else build them from
the training-side sets of the shared data (with progress bars) and load the result. A valid
directory that only lacks the HNSW index gets just that part added.

Does not know how indices are counted or verified (``build.py``, ``manifest.py`` do).
"""

from __future__ import annotations

import sys
from pathlib import Path

from evospec.common import DEFAULT_DATA, evospec_home
from evospec.models.loading import LoadedModel
from evospec.models.registry import REGISTRY
from indices.build import add_hnsw, build_from_texts
from indices.corpus import training_texts
from indices.manifest import IndexBundle, IndexLoadError, load_indices


def default_index_dir(model_name: str) -> Path:
    return evospec_home() / "indices" / model_name


def model_source(loaded: LoadedModel) -> str:
    """What ``load_model`` needs to load ``loaded`` again: its registered name, or its path."""
    return loaded.name if loaded.name in REGISTRY else str(loaded.source)


def ensure_indices(
    loaded_model: LoadedModel,
    *,
    data_dir: Path | None = None,
    directory: Path | None = None,
    need_hnsw: bool = True,
    progress: bool = True,
) -> IndexBundle:
    """The verified indices of ``loaded_model``, building what is missing or stale first.

    ``directory`` defaults to ``default_index_dir(loaded_model.name)``; ``data_dir`` to the shared
    data folder next to the checkout.
    """
    weight = loaded_model.model.lm_head.weight  # [V, D]
    directory = Path(directory) if directory is not None else default_index_dir(loaded_model.name)
    try:
        return load_indices(directory, weight, need_hnsw=need_hnsw)
    except IndexLoadError as exc:
        if progress:
            print(f"[evospec-index] {exc.path}: {exc.problem}; building", file=sys.stderr)
        if exc.kind == "no_hnsw":
            add_hnsw(directory, weight, progress=progress)
            return load_indices(directory, weight, need_hnsw=need_hnsw)
    if loaded_model.codec is None:
        raise IndexLoadError(
            directory,
            "cannot build indices: the model carries no tokenizer",
            "missing",
            "Build them with evospec-index build --model MODEL_WITH_TOKENIZER --out DIR",
        )
    data = Path(data_dir) if data_dir is not None else DEFAULT_DATA
    build_from_texts(
        weight,
        loaded_model.codec,
        training_texts(data),
        directory,
        model_name=loaded_model.name,
        model_source=model_source(loaded_model),
        corpus_description=f"training-side sets of {data}",
        hnsw=need_hnsw,
        progress=progress,
    )
    return load_indices(directory, weight, need_hnsw=need_hnsw)

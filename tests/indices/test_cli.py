"""``evospec-index`` end to end on a tiny random model folder and a tiny corpus: build, info and
check (0 when intact, 2 naming the file when not, 2 for another model), refusals, ``-m``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from indices.cli import main
from indices.manifest import BIGRAM_FILE, HNSW_FILE, MANIFEST_NAME
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for, write_model_folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(model folder, another model's folder with the same tokenizer, corpus folder)."""
    root = tmp_path_factory.mktemp("cli")
    codec = tiny_codec(CORPUS.split("\n\n") * 4)
    model = write_model_folder(root / "tiny-model", tiny_model_for(codec, 0), codec)
    other = write_model_folder(root / "other-model", tiny_model_for(codec, 1), codec)
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(CORPUS)
    (corpus / "b.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in CORPUS.split("\n\n")))
    return model, other, corpus


def test_build_info_check(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, other, corpus = setup
    out = tmp_path / "idx"
    argv = ["build", "--model", str(model), "--corpus", str(corpus), "--out", str(out), "--min-count", "1"]
    assert main([*argv, "--threads", "1", "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert f"wrote {out}" in stdout and "edges (min_count=1" in stdout
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["model_name"] == "tiny-model" and manifest["model_source"] == str(model)
    assert manifest["corpus"]["num_documents"] == 8 and manifest["bigram"]["min_count"] == 1

    assert main(["info", str(out)]) == 0
    assert "fingerprint" in capsys.readouterr().out
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest

    assert main(["check", "--model", str(model), str(out), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {out}")
    assert main(["check", "--model", str(other), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "built for another model" in err and f"evospec-index build --model {model}" in err

    data = bytearray((out / BIGRAM_FILE).read_bytes())
    data[-30] ^= 1
    (out / BIGRAM_FILE).write_bytes(bytes(data))
    assert main(["check", "--model", str(model), str(out), "--no-progress"]) == 2
    assert f"{out / BIGRAM_FILE}: sha256 mismatch" in capsys.readouterr().err


def test_no_hnsw_and_max_tokens(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _, corpus = setup
    out = tmp_path / "idx"
    argv = ["build", "--model", str(model), "--corpus", str(corpus / "a.txt"), "--out", str(out)]
    assert main([*argv, "--no-hnsw", "--max-tokens", "25", "--no-progress"]) == 0
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["hnsw"] is None and manifest["corpus"]["num_tokens"] == 25
    assert not (out / HNSW_FILE).exists()
    assert main(["check", "--model", str(model), str(out), "--no-progress"]) == 0  # checks what it lists
    assert "hnsw absent" in capsys.readouterr().out


def test_refusals_exit_2(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _, _ = setup
    evil = tmp_path / "humaneval"
    evil.mkdir()
    (evil / "p.txt").write_text("def f(): pass")
    base = ["build", "--model", str(model), "--out", str(tmp_path / "idx"), "--no-progress"]
    assert main([*base, "--corpus", str(evil)]) == 2
    assert "evaluation-only set 'humaneval'" in capsys.readouterr().err
    assert main(base) == 2
    assert "--training-data" in capsys.readouterr().err
    assert main([*base, "--training-data", str(tmp_path / "no-data")]) == 2
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["check", "--model", str(tmp_path / "no-model"), str(tmp_path / "nothing")]) == 2


def test_module_help_subprocess() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "indices", "build", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    for flag in ("--corpus", "--training-data", "--hnsw-m", "--ef-construction", "--min-prob", "--no-hnsw"):
        assert flag in proc.stdout
    assert "(default: 32)" in proc.stdout and "(default: 0.0001)" in proc.stdout and "None" not in proc.stdout


def test_sources_pick_training_sets(setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _, corpus = setup
    base = ["build", "--model", str(model), "--out", str(tmp_path / "idx"), "--no-progress"]
    assert main([*base, "--corpus", str(corpus), "--sources", "oasst"]) == 2
    assert "--sources picks training-side sets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--training-data", str(tmp_path), "--sources", "oasst,humaneval"])
    assert "unknown training sources ['humaneval']" in capsys.readouterr().err


def test_package_counts_redistributable_sets_only(
    setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import indices.packaged as packaged
    from indices.corpus import REDISTRIBUTABLE, TRAINING_SOURCES

    read: list[str] = []
    monkeypatch.setattr(
        packaged, "training_texts", lambda d, names: read.extend(names) or iter(CORPUS.split("\n\n"))
    )
    model, _, _ = setup
    data, out = tmp_path / "data", tmp_path / "packaged"
    (data / "oasst").mkdir(parents=True)
    (data / "oasst" / "SOURCE_COMMIT").write_text("abc123\n")
    assert main(["package", "--model", str(model), "--training-data", str(tmp_path / "nope")]) == 2
    argv = [
        "package",
        "--model",
        str(model),
        "--training-data",
        str(data),
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert read == list(REDISTRIBUTABLE)
    manifest = packaged.read_packaged(out).manifest
    assert manifest.hnsw is None and [s.name for s in manifest.corpus.sources] == list(REDISTRIBUTABLE)
    assert manifest.corpus.sources[0].origin.endswith("shared/data/oasst @ abc123")
    assert set(manifest.corpus.left_out) == {n for n, s in TRAINING_SOURCES.items() if not s.redistributable}
    assert manifest.corpus.command == " ".join(["evospec-index", *argv[:-1]])
    assert "rebuild:  evospec-index package" in capsys.readouterr().out
    assert "license: Apache-2.0" in (out / packaged.NOTICE_FILE).read_text()


def test_clusters_are_added_and_a_bad_k_is_a_clear_error(setup, tmp_path: Path, capsys) -> None:
    model, _, corpus = setup
    out = tmp_path / "idx"
    argv = ["build", "--model", str(model), "--corpus", str(corpus), "--out", str(out), "--no-hnsw"]
    assert main([*argv, "--no-progress"]) == 0
    assert main(["clusters", "--model", str(model), "--out", str(out), "--k", "0", "--no-progress"]) == 2
    assert "k must be in [1," in capsys.readouterr().err
    assert main(["clusters", "--model", str(model), "--out", str(out), "--k", "4", "--no-progress"]) == 0
    assert "4 clusters of" in capsys.readouterr().out
    assert "clusters.npy" in json.loads((out / MANIFEST_NAME).read_text())["files"]


def test_check_refuses_a_router_trained_on_clusters_rebuilt_since(
    setup, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`evospec-index clusters` rebuilds clusters.npy under a DynaSpec router trained on the old
    ones: the files' hashes all match their listing, but serving dynaspec would fail; check says so."""
    from evospec.models.loading import load_model
    from evospec.vocab.router import ClusterRouter, save_router
    from indices.manifest import DYNASPEC_FILE, add_index_file, load_indices

    model, _, corpus = setup
    out = tmp_path / "idx"
    argv = ["build", "--model", str(model), "--corpus", str(corpus / "a.txt"), "--out", str(out), "--no-hnsw"]
    assert main([*argv, "--no-progress"]) == 0
    clusters = ["clusters", "--model", str(model), "--out", str(out), "--k", "4", "--no-progress"]
    assert main([*clusters, "--seed", "1"]) == 0
    weight = load_model(str(model), progress=False).model.lm_head.weight
    bundle = load_indices(out, weight, need_hnsw=False)
    dim = bundle.manifest.hidden_size

    def write(tmp: Path) -> None:
        save_router(
            ClusterRouter(dim, 4, 8),
            tmp,
            clusters=bundle.clusters,
            fingerprint=bundle.manifest.model_fingerprint,
        )

    add_index_file(out, weight, DYNASPEC_FILE, write, {"note": "a test router"}, seconds=0.0)
    assert main(["check", "--model", str(model), str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main([*clusters, "--seed", "2"]) == 0  # other clusters under the same router
    assert main(["check", "--model", str(model), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "other vocabulary clusters" in err and "--out DIR" in err

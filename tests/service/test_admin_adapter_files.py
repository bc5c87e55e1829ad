"""Admin adapter save / load stay inside the adapter folder (issue 21, item 5).

Clients name adapter files; they never give paths. ``..``, separators, absolute paths, NUL,
hidden names and over-long names are refused with 400 ``invalid_path`` before the file system
is touched; a symlink planted in the folder (or as the folder) is never followed; every load
of a name that is not a regular file in the folder answers the same 404; a failed write leaves
the previous file as it was. Each test also ran against the code before the fix and failed
there (paths were written relative to the working directory, symlinks followed, existence
leaked through different errors).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import SpeculativeDecoder, make_decoder
from evospec.decoding.tree import TreeConfig
from tests.service.helpers import LiveServer, api_error
from tests.vocab.helpers import SMALL, stand_in_indices

TOKEN = "adapter-files-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TREE = TreeConfig(top_k=4, depth=3, total_tokens=8)
FAST = AdaptConfig(buffer_size=4, lr=1e-2, context=8, k_logit=16, rank=4, alpha=4)
UNSAFE = [
    "../escape",
    "../../etc/passwd",
    "a/b",
    "/tmp/evospec-outside.safetensors",
    "..",
    ".",
    ".hidden",
    "a\\b",
    "a\x00b",
    "x" * 65,
    "",
    "sp ace",
    "ünïcode",
]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$EVOSPEC_HOME`` in the test's folder, and a working directory next to it."""
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("EVOSPEC_HOME", str(home))
    monkeypatch.chdir(work)
    return home


@pytest.fixture
def make(tiny, codec, head) -> Callable[[], SpeculativeDecoder]:
    def factory() -> SpeculativeDecoder:
        return make_decoder(
            "clora",
            tiny,
            eos_ids=codec.eos_ids,
            draft=head,
            tree=TREE,
            vocab=SMALL,
            indices=stand_in_indices(tiny),
            adapt=FAST,
        )

    return factory


@pytest.fixture
def live(serve, make, home: Path) -> LiveServer:
    return serve(make(), admin_token=TOKEN)


def _files(root: Path) -> list[Path]:
    """Every file and link under ``root`` (links are not followed)."""
    return sorted(p for p in root.rglob("*") if p.is_symlink() or p.is_file())


def test_save_and_load_refuse_paths_and_unsafe_names(live: LiveServer, tmp_path: Path) -> None:
    with live.http(headers=AUTH) as http:
        for bad in UNSAFE:
            for field in ("path", "name"):
                for route in ("/admin/adapter/save", "/admin/adapter/load"):
                    err = api_error(http.post(route, json={field: bad}), 400, "invalid_path")
                    assert err["param"] == field, (route, field, bad)
        err = api_error(
            http.post("/admin/adapter/save", json={"name": "a", "path": "b"}), 400, "invalid_path"
        )
        assert "not both" in err["message"]
    assert _files(tmp_path) == []  # nothing written anywhere, the adapter folder not even created


def test_save_writes_named_files_in_the_adapter_folder(live: LiveServer, home: Path) -> None:
    folder = home / "adapters"
    with live.http(headers=AUTH) as http:
        r = http.post("/admin/adapter/save").json()
        assert r["name"] == "tiny-llama.clora" and Path(r["path"]) == folder / "tiny-llama.clora.safetensors"
        assert http.post("/admin/adapter/save", json={"name": "mine"}).json()["name"] == "mine"
        old = http.post("/admin/adapter/save", json={"path": "old-style.safetensors"}).json()  # a bare name
        assert old["name"] == "old-style" and Path(old["path"]) == folder / "old-style.safetensors"
        keyed = http.post("/admin/adapter/save", json={"key": "../../x"}).json()  # keys never make paths
        assert keyed["name"].startswith("tiny-llama.clora.") and Path(keyed["path"]).parent == folder
        assert http.post("/admin/adapter/save", json={"key": "tenant-1"}).json()["name"] == (
            "tiny-llama.clora.tenant-1"
        )
        for name in ("mine", "mine.safetensors", "old-style", "tiny-llama.clora"):
            loaded = http.post("/admin/adapter/load", json={"name": name})
            assert loaded.status_code == 200, loaded.text
    names = sorted(p.name for p in folder.iterdir())
    assert not any(n.startswith(".") for n in names)  # no temp file left behind
    assert [p.parent for p in _files(home)] == [folder] * len(names) and len(names) == 5


def test_a_configured_folder_is_used(serve, make, home: Path, tmp_path: Path) -> None:
    live = serve(make(), admin_token=TOKEN, adapter_dir=str(tmp_path / "mine"))
    with live.http(headers=AUTH) as http:
        r = http.post("/admin/adapter/save", json={"name": "x"}).json()
        assert Path(r["path"]) == tmp_path / "mine" / "x.safetensors" and Path(r["path"]).is_file()
        assert http.post("/admin/adapter/load", json={"name": "x"}).status_code == 200
    assert not (home / "adapters").exists()


def test_save_never_follows_a_symlink_in_the_folder(live: LiveServer, home: Path, monkeypatch) -> None:
    folder = home / "adapters"
    folder.mkdir(parents=True)
    outside = home.parent / "outside.txt"
    outside.write_text("keep")
    (folder / "evil.safetensors").symlink_to(outside)
    (folder / "adir.safetensors").mkdir()
    monkeypatch.chdir(folder)  # before the fix a bare name was a path from the working directory
    with live.http(headers=AUTH) as http:
        for name in ("evil", "adir"):
            err = api_error(
                http.post("/admin/adapter/save", json={"path": f"{name}.safetensors"}), 400, "invalid_path"
            )
            assert "not a regular file" in err["message"]
    assert outside.read_text() == "keep" and (folder / "evil.safetensors").is_symlink()
    assert (folder / "adir.safetensors").is_dir()


def test_a_symlinked_adapter_folder_is_refused(live: LiveServer, home: Path) -> None:
    elsewhere = home.parent / "elsewhere"
    elsewhere.mkdir()
    home.mkdir()
    (home / "adapters").symlink_to(elsewhere, target_is_directory=True)
    with live.http(headers=AUTH) as http:
        for route, body in (("/admin/adapter/save", None), ("/admin/adapter/load", {"name": "x"})):
            r = http.post(route, json=body)
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "adapter_folder_unsafe"
    assert list(elsewhere.iterdir()) == []


def test_load_answers_one_404_for_anything_but_a_regular_file(
    live: LiveServer, home: Path, tmp_path: Path, monkeypatch
) -> None:
    folder = home / "adapters"
    with live.http(headers=AUTH) as http:
        saved = http.post("/admin/adapter/save", json={"name": "real"}).json()
        outside = tmp_path / "outside.safetensors"
        outside.write_bytes(Path(saved["path"]).read_bytes())  # a valid adapter, outside the folder
        (folder / "link.safetensors").symlink_to(outside)
        (folder / "adir.safetensors").mkdir()
        os.mkfifo(folder / "fifo.safetensors")  # must not block the server
        monkeypatch.chdir(folder)
        messages = []
        for name in ("missing", "link", "adir", "fifo"):
            err = api_error(
                http.post("/admin/adapter/load", json={"path": f"{name}.safetensors"}),
                404,
                "adapter_not_found",
            )
            messages.append(err["message"].replace(name, "NAME"))
        assert len(set(messages)) == 1, messages
        # paths outside are refused before the file system is asked: an existing file and a
        # missing one get the same answer
        answers = {
            api_error(http.post("/admin/adapter/load", json={"path": p}), 400, "invalid_path")[
                "message"
            ].replace(p, "P")
            for p in (str(outside), str(tmp_path / "nope.safetensors"), "/etc/passwd")
        }
        assert len(answers) == 1, answers
        junk = folder / "junk.safetensors"
        junk.write_bytes(b"not a safetensors file")
        err = api_error(http.post("/admin/adapter/load", json={"name": "junk"}), 400, "invalid_adapter")
        assert str(tmp_path) not in err["message"]


def test_a_failed_write_keeps_the_previous_adapter(live: LiveServer, home: Path, monkeypatch) -> None:
    import evospec.files

    with live.http(headers=AUTH) as http:
        saved = http.post("/admin/adapter/save", json={"name": "keep"}).json()
        before = Path(saved["path"]).read_bytes()

        def crash(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(evospec.files.os, "replace", crash)  # after the temp file is written
        r = http.post("/admin/adapter/save", json={"name": "keep"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "adapter_write_failed", r.text
        assert "No space left on device" in r.json()["error"]["message"]
    assert Path(saved["path"]).read_bytes() == before
    assert sorted(p.name for p in (home / "adapters").iterdir()) == ["keep.safetensors"]  # temp removed

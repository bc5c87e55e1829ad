"""``evospec/files.py``, the confined folder the admin adapter files and restart snapshots use:
which names pass, that nothing is reached through a symlink (as the folder, or as a file in
it), that a read cannot tell a missing name from a non-regular file, and that a write is
atomic (a failure before the rename leaves the old file and no temp file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import evospec.files
from evospec.files import (
    NAME_MAX,
    UnsafeFolder,
    UnsafeName,
    check_name,
    open_folder,
    plain_name,
    read_file,
    remove_stale_temps,
    write_atomic,
)

GOOD = ["a", "A-z_0.9", "tiny-llama.clora", "x" * NAME_MAX, "-dash", "v1..2"]
BAD = ["", ".", "..", ".hidden", "a/b", "../x", "/abs", "a\\b", "a\x00b", "x" * (NAME_MAX + 1), "sp ace", "é"]


@pytest.mark.parametrize("name", GOOD)
def test_plain_names_pass(name: str) -> None:
    assert check_name(name) == name and plain_name(name) == name


@pytest.mark.parametrize("name", BAD)
def test_anything_else_is_refused(name: str) -> None:
    with pytest.raises(UnsafeName, match="is not a plain name"):
        check_name(name)
    made = plain_name(name)  # a made-up name from the same text is always plain, and distinct
    assert check_name(made) == made and made != plain_name(name + "x")


def test_a_symlinked_or_missing_folder(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    (tmp_path / "file").write_text("x")
    for bad in ("link", "file"):
        with pytest.raises(UnsafeFolder), open_folder(tmp_path / bad):
            pass
    with pytest.raises(FileNotFoundError), open_folder(tmp_path / "missing"):
        pass
    with open_folder(tmp_path / "new" / "deep", create=True) as fd:
        write_atomic(fd, "f", b"data")
    assert (tmp_path / "new" / "deep" / "f").read_bytes() == b"data"


def test_reads_see_regular_files_only(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "ok").write_bytes(b"fine")
    (folder / "link").symlink_to(outside)
    (folder / "dir").mkdir()
    os.mkfifo(folder / "fifo")
    with open_folder(folder) as fd:
        assert read_file(fd, "ok") == b"fine"
        messages = set()
        for name in ("missing", "link", "dir", "fifo"):
            with pytest.raises(FileNotFoundError) as err:
                read_file(fd, name)
            messages.add(str(err.value).replace(name, "N"))
        assert messages == {"N: no such file"}
        for bad in ("../outside", "/etc/passwd", ".."):
            with pytest.raises(UnsafeName):
                read_file(fd, bad)


def test_writes_never_replace_a_symlink_or_a_folder(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "link").symlink_to(outside)
    (folder / "dir").mkdir()
    with open_folder(folder) as fd:
        for name in ("link", "dir"):
            with pytest.raises(UnsafeName, match="not a regular file"):
                write_atomic(fd, name, b"new")
        with pytest.raises(UnsafeName):
            write_atomic(fd, "../escape", b"new")
    assert outside.read_bytes() == b"keep" and not (tmp_path / "escape").exists()
    assert sorted(p.name for p in folder.iterdir()) == ["dir", "link"]


def test_a_write_that_fails_before_the_rename_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    with open_folder(tmp_path) as fd:
        write_atomic(fd, "f", b"old")

        def crash(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(evospec.files.os, "replace", crash)
        with pytest.raises(OSError, match="No space left"):
            write_atomic(fd, "f", b"new")
        monkeypatch.undo()
        assert read_file(fd, "f") == b"old" and os.listdir(fd) == ["f"]
        write_atomic(fd, "f", b"new")
        assert read_file(fd, "f") == b"new"


def test_stale_temps_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    for name in (".f.123.abcd.tmp", ".f.9.0000.tmp", ".g.1.x.tmp", "f"):
        (tmp_path / name).write_bytes(b"")
    with open_folder(tmp_path) as fd:
        assert remove_stale_temps(fd, "f") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".g.1.x.tmp", "f"]

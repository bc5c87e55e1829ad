"""Files written and read on a client's behalf: plain names confined to one folder, atomic writes.

Owns: :func:`check_name` (the one pattern a client-given file name must match) and
:func:`plain_name` (any text made into such a name),
:func:`open_folder` (a folder opened without following a symlink in its last component),
:func:`read_file` / :func:`write_atomic` (files in that folder, opened by name relative to the
folder's descriptor with ``O_NOFOLLOW``: neither ``..``, a separator, an absolute path nor a
symlink planted in the folder, or as the folder, reaches outside it) and
:func:`remove_stale_temps`. Knows nothing about adapters or snapshots; imports nothing of the
project. POSIX only (``dir_fd``, ``O_NOFOLLOW``, ``O_DIRECTORY``), like the rest of the server.

Atomic write: the bytes go to a temp file in the same folder (``.<name>.<pid>.<random>.tmp``:
its leading dot keeps it out of :func:`check_name`'s names), which is fsynced, renamed over the
target with ``os.replace`` and the folder fsynced. A reader sees the old file or the new one,
never a part, even if the writer is killed at any point; a killed writer can leave its temp
file behind, which :func:`remove_stale_temps` clears.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

NAME_MAX = 64
NAME_RULE = f"use 1 to {NAME_MAX} ASCII letters, digits, '.', '_' or '-', not starting with '.' (no paths)"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # ASCII letters, digits, '.', '_', '-'; no leading dot


class UnsafePath(ValueError):
    """A name or folder that will not be used; the message says why and names nothing outside."""


class UnsafeName(UnsafePath):
    """A client's name is not a plain name, or names something other than a regular file."""


class UnsafeFolder(UnsafePath):
    """The folder is a symlink or not a folder."""


def check_name(name: str) -> str:
    """``name`` if it is a plain file name: 1 to :data:`NAME_MAX` ASCII letters, digits, ``.``,
    ``_`` or ``-``, not starting with a dot (so no ``.``, ``..``, hidden or temp names, no
    separator, no NUL); :class:`UnsafeName` otherwise."""
    if not isinstance(name, str) or not 1 <= len(name) <= NAME_MAX or not _NAME.fullmatch(name):
        raise UnsafeName(f"{name!r} is not a plain name: {NAME_RULE}")
    return name


def plain_name(text: str) -> str:
    """``text`` itself when it passes :func:`check_name`; otherwise its disallowed characters
    become ``_`` (leading dots dropped, cut to fit) and 16 hex digits of its SHA-256 keep
    different texts apart. For names the server makes up (from a model name or a key)."""
    try:
        return check_name(text)
    except UnsafeName:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".")[: NAME_MAX - len(digest) - 1]
        return f"{stem}-{digest}" if stem else digest


def _component(name: str) -> str:
    """``name`` if it is one path component (the minimum every file here must be; client input
    passes :func:`check_name` first)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise UnsafeName(f"{name!r} is not a file name")
    return name


@contextlib.contextmanager
def open_folder(path: str | Path, *, create: bool = False) -> Iterator[int]:
    """A read-only descriptor of the folder ``path`` for ``dir_fd`` calls, closed on exit.

    ``create`` makes it (and its parents) first. The last component must be a real folder,
    not a symlink (:class:`UnsafeFolder`); the parents are the operator's business. A missing
    folder raises FileNotFoundError."""
    path = Path(path)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
        raise UnsafeFolder(
            f"{path} is a symlink or not a folder ({exc.strerror}): refusing to use it"
        ) from None
    try:
        yield fd
    finally:
        os.close(fd)


def read_file(folder: int, name: str) -> bytes:
    """The bytes of the regular file ``name`` in the folder open as ``folder``.

    A missing name, a symlink, a folder, a FIFO or any other non-regular file all raise the
    same FileNotFoundError (the caller cannot tell them apart, so nothing leaks)."""
    _component(name)
    missing = FileNotFoundError(f"{name}: no such file")
    try:  # O_NONBLOCK: a FIFO planted in the folder must not block the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except (FileNotFoundError, NotADirectoryError):
        raise missing from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink
            raise missing from None
        raise
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    if not regular:
        os.close(fd)
        raise missing
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_atomic(folder: int, name: str, data: bytes | bytearray | memoryview) -> None:
    """Replace (or create) the file ``name`` in the folder open as ``folder`` with ``data``,
    atomically (module docstring). A ``name`` that exists as anything but a regular file (a
    symlink, a folder) is refused with :class:`UnsafeName`; OSError from the file system
    (disk full, permissions) propagates after the temp file is removed."""
    _component(name)
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeName(
                f"{name} exists and is not a regular file (a symlink or a folder): not replacing it"
            )
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder
    )
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    os.fsync(folder)  # the rename itself survives a power cut


def remove_stale_temps(folder: int, name: str) -> int:
    """Delete the temp files a killed :func:`write_atomic` of ``name`` left in ``folder`` (call it
    when no other writer of ``name`` runs, e.g. at start-up); how many went."""
    prefix, removed = f".{name}.", 0
    for entry in os.listdir(folder):
        if entry.startswith(prefix) and entry.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=folder)
                removed += 1
    return removed

"""Restart safety: what the server learnt (ARC buffer, online adapters) snapshotted and restored.

Owns: the snapshot file (:func:`encode_snapshot` / :func:`decode_snapshot`), the identity a
snapshot is bound to (:class:`Identity`: method, model and draft-head fingerprints), and
:class:`StateKeeper`, which restores the snapshot once at start-up, takes one every
``snapshot_minutes`` and one at shutdown, and reports what happened (log lines and
``/admin/state``'s ``persistence`` section). Reads and changes the decoder's state only
through :meth:`~service.engine.Engine.call` (the engine thread's safe points); file work runs
on the caller's thread. Knows nothing about HTTP.

What a snapshot keeps: the ARC buffer (``ActiveVocab.dynamic_state``: lists, ``p``, clock,
events) when the method has one and ``vocab.persist`` is on, and every adapter key that
published at least one version (its adapter tensors and version; replay buffers, optimizer
moments and in-flight retrievals are not kept). Taken while the engine is at a safe point,
after the adapter's worker has finished what it holds.

The file (``<state_dir>/<model>.<method>.snapshot``; :data:`MAGIC`, then the SHA-256 of the
payload, then the payload): the payload is a safetensors file whose tensors are the adapters'
(``adapters.<i>.<tensor name>``) and whose metadata ``snapshot`` is JSON: ``format``
(:data:`FORMAT`), ``method``, ``model`` (name, fingerprint), ``head`` (fingerprint or null),
``created`` (Unix seconds), ``arc`` (the ARC state or null), ``adapt`` (the adapter-file
header of the adapter config: mode, LoRA rank / alpha, head shape) and ``adapters`` (key,
version, tensor names). Written atomically (``evospec/files.py``): a crash at any point
leaves the previous snapshot whole.

Restore checks, in order: the magic and checksum (else *corrupt*: truncated, flipped bits,
not a snapshot), the format, then method, model and head fingerprints and the adapter config
(else *mismatch*); then the ARC state must fit the configured buffer and the tensors the
adapter. A refused snapshot is logged as a warning, renamed ``<file>.rejected`` (the latest
one kept, for a look) and otherwise ignored: start-up goes on with empty state, and the next
snapshot replaces it. Nothing here raises into start-up or shutdown.

Fingerprints: SHA-256 over the architecture config and, per parameter, its name, shape and
64 evenly spaced values rounded to bfloat16 -- cheap at any size, blind to dtype and device
(the learnt state is about token ids and draft weights, valid at any precision), and changed
by any retrained or different model or head.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from evospec.adapt.adapter_file import adapter_metadata, check_metadata, safetensors_metadata
from evospec.adapt.online import OnlineAdapter
from evospec.files import UnsafePath, open_folder, plain_name, read_file, remove_stale_temps, write_atomic
from evospec.vocab.active import ActiveVocab
from service.engine import Engine

log = logging.getLogger("evospec.service.persistence")

FORMAT = 1
MAGIC = b"EVOSPEC-SNAPSHOT/1\n"
_DIGEST = 32  # bytes of SHA-256
_SAMPLES = 64  # values per parameter in a fingerprint
CALL_TIMEOUT_S = 120.0  # longest wait for the engine's safe point (and the adapter worker) per snapshot


class SnapshotError(ValueError):
    """A snapshot that will not be restored; ``kind`` is ``"corrupt"`` or ``"mismatch"``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# -- identity -------------------------------------------------------------------------------------
def fingerprint(module: torch.nn.Module) -> str:
    """A cheap identity of a module's architecture and weights (module docstring)."""
    h = hashlib.sha256()
    cfg = getattr(module, "cfg", None)
    if cfg is not None and dataclasses.is_dataclass(cfg):
        h.update(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, p in module.named_parameters():
            flat = p.detach().reshape(-1)
            n = min(_SAMPLES, flat.numel())  # evenly spaced, in int64 (float32 spacing overshoots > 2^24)
            idx = torch.arange(n, device=flat.device) * max(flat.numel() - 1, 0) // max(n - 1, 1)
            sample = flat[idx].to(torch.bfloat16).float().cpu()
            h.update(f"{name}{tuple(p.shape)}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class Identity:
    """What a snapshot was taken for; every field must match for it to be restored."""

    method: str
    model_name: str  # informative (messages); the fingerprint decides
    model: str  # fingerprint of the target
    head: str | None  # fingerprint of the draft head as loaded (before any adaptation); None: no head

    @classmethod
    def of(
        cls, method: str, model_name: str, model: torch.nn.Module, head: torch.nn.Module | None
    ) -> Identity:
        return cls(method, model_name, fingerprint(model), None if head is None else fingerprint(head))


# -- the file -------------------------------------------------------------------------------------
@dataclass
class AdapterEntry:
    key: str  # "" = the default key
    version: int
    tensors: dict[str, torch.Tensor]  # the trainer's adapter tensors (CPU)


@dataclass
class Snapshot:
    identity: Identity
    created: float  # Unix seconds
    arc: dict | None = None  # ActiveVocab.dynamic_state()
    adapt: dict[str, str] | None = None  # adapter-file header of the adapter's config (mode, rank, head)
    adapters: list[AdapterEntry] = field(default_factory=list)  # least recently used first

    def signature(self) -> str:
        """Changes whenever the kept state does (the ARC clock ticks every round, versions every
        update); equal signatures need no new write."""
        versions = [(a.key, a.version) for a in self.adapters]
        return json.dumps([self.arc, versions], sort_keys=True)


def encode_snapshot(snap: Snapshot) -> bytes:
    from safetensors.torch import save

    tensors, entries = {}, []
    for i, a in enumerate(snap.adapters):
        entries.append({"key": a.key, "version": a.version, "tensors": sorted(a.tensors)})
        tensors.update({f"adapters.{i}.{n}": t.detach().contiguous().cpu() for n, t in a.tensors.items()})
    ident = snap.identity
    meta = {
        "format": FORMAT,
        "method": ident.method,
        "model": {"name": ident.model_name, "fingerprint": ident.model},
        "head": ident.head,
        "created": snap.created,
        "arc": snap.arc,
        "adapt": snap.adapt,
        "adapters": entries,
    }
    payload = save(tensors, metadata={"snapshot": json.dumps(meta)})
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode_snapshot(data: bytes) -> Snapshot:
    """The snapshot in ``data``; :class:`SnapshotError` ``corrupt`` for anything damaged."""
    from safetensors.torch import load

    head = len(MAGIC) + _DIGEST
    if not data.startswith(MAGIC):
        raise SnapshotError("corrupt", "not an EvoSpec snapshot (or another format version)")
    payload = memoryview(data)[head:]
    if len(data) < head or hashlib.sha256(payload).digest() != data[len(MAGIC) : head]:
        raise SnapshotError("corrupt", "checksum mismatch: the file is truncated or damaged")
    try:
        meta = json.loads(safetensors_metadata(payload)["snapshot"])
        tensors = load(bytes(payload))
        if meta["format"] != FORMAT:
            raise SnapshotError("mismatch", f"snapshot format {meta['format']!r}, this server reads {FORMAT}")
        ident = Identity(meta["method"], meta["model"]["name"], meta["model"]["fingerprint"], meta["head"])
        adapters = [
            AdapterEntry(e["key"], int(e["version"]), {n: tensors[f"adapters.{i}.{n}"] for n in e["tensors"]})
            for i, e in enumerate(meta["adapters"])
        ]
        return Snapshot(ident, float(meta["created"]), meta["arc"], meta["adapt"], adapters)
    except SnapshotError:
        raise
    except Exception as exc:  # a checksummed file that still does not parse: written by something else
        raise SnapshotError("corrupt", f"unreadable snapshot ({type(exc).__name__}: {exc})") from None


def check_identity(snap: Snapshot, ident: Identity) -> None:
    """:class:`SnapshotError` ``mismatch`` unless ``snap`` was taken for ``ident``."""
    got = snap.identity
    if got.method != ident.method:
        raise SnapshotError("mismatch", f"taken under method {got.method}, serving {ident.method}")
    if got.model != ident.model:
        raise SnapshotError(
            "mismatch",
            f"taken for another model ({got.model_name} {got.model[:12]}, serving "
            f"{ident.model_name} {ident.model[:12]})",
        )
    if got.head != ident.head:
        raise SnapshotError("mismatch", "taken for another draft head (its weights differ)")


# -- capture and apply (engine thread) ----------------------------------------------------------
def capture(ident: Identity, vocab: ActiveVocab | None, adapter: OnlineAdapter | None) -> Snapshot:
    """The learnt state now (``vocab``: None when the ARC buffer is not kept)."""
    snap = Snapshot(ident, time.time(), arc=vocab.dynamic_state() if vocab is not None else None)
    if adapter is not None:
        snap.adapt = adapter_metadata(adapter.cfg, adapter.head, 0)
        snap.adapters = [AdapterEntry(k, v, t) for k, v, t in adapter.learnt()]
    return snap


def apply(snap: Snapshot, vocab: ActiveVocab | None, adapter: OnlineAdapter | None) -> dict[str, Any]:
    """Install ``snap`` (identity already checked): all of it, or nothing (SnapshotError)."""
    if adapter is not None and snap.adapters:
        try:
            check_metadata(snap.adapt or {}, adapter.cfg, adapter.head, "snapshot adapters")
        except ValueError as exc:
            raise SnapshotError("mismatch", str(exc)) from None
    try:
        if vocab is not None and snap.arc is not None:
            vocab.load_dynamic_state(snap.arc)  # validates first: untouched when it raises
        for a in snap.adapters if adapter is not None else ():
            adapter.install(a.tensors, a.key, version=a.version)
    except Exception as exc:
        if vocab is not None and snap.arc is not None:
            vocab.reset_dynamic()
        if adapter is not None:
            adapter.reset(all_keys=True)
        raise SnapshotError("mismatch", f"does not fit this server's settings ({exc})") from None
    return {
        "arc_size": None if snap.arc is None or vocab is None else len(snap.arc["t1"]) + len(snap.arc["t2"]),
        "adapter_keys": len(snap.adapters) if adapter is not None else 0,
    }


# -- the keeper -----------------------------------------------------------------------------------
def write_snapshot_file(folder: Path, name: str, data: bytes) -> None:
    """Write a snapshot's bytes atomically (the folder is created)."""
    with open_folder(folder, create=True) as fd:
        write_atomic(fd, name, data)


class StateKeeper:
    """Restores, snapshots and reports one server's learnt state (module docstring)."""

    def __init__(
        self,
        engine: Engine,
        identity: Identity,
        folder: Path,
        *,
        interval_s: float,
        keep_arc: bool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.identity = identity
        self.folder = Path(folder)
        self.file = plain_name(f"{identity.model_name}.{identity.method}") + ".snapshot"
        self.interval_s = interval_s
        self.vocab = engine.vocab if keep_arc else None
        self.adapter = engine.adapter
        self._clock = clock
        self._writing = threading.Lock()  # one snapshot at a time (the timer, shutdown, tests)
        self._lock = threading.Lock()  # guards _status (held for microseconds: /admin/state reads it)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_signature: str | None = None
        self._status: dict[str, Any] = {
            "restored": None,  # what the restore found: {"outcome", "detail", ...}
            "snapshots": 0,  # written
            "unchanged": 0,  # skipped: nothing changed since the last one
            "failures": 0,
            "last_snapshot": None,  # {"time", "bytes", "seconds"}
            "last_error": None,
        }

    @property
    def path(self) -> Path:
        return self.folder / self.file

    def status(self) -> dict[str, Any]:
        """The ``persistence`` section of ``/admin/state``."""
        with self._lock:
            return {
                "enabled": True,
                "file": str(self.path),
                "keeps": [
                    *(["arc"] if self.vocab is not None else []),
                    *(["adapters"] if self.adapter is not None else []),
                ],
                "interval_minutes": self.interval_s / 60 if self.interval_s > 0 else None,
                **{k: (dict(v) if isinstance(v, dict) else v) for k, v in self._status.items()},
            }

    # -- start-up ---------------------------------------------------------------------------
    def restore(self) -> str:
        """Install the snapshot on disk, if there is a good one; one line saying what happened.
        Call before the engine starts serving. Never raises."""
        try:
            outcome, detail = self._restore()
        except Exception as exc:  # a bug here must not stop the server
            log.exception("persistence: restore failed")
            outcome, detail = "failed", f"{type(exc).__name__}: {exc}"
        with self._lock:
            self._status["restored"] = {"outcome": outcome, "detail": detail, "time": self._clock()}
        line = f"restart state {outcome}: {detail}"
        (log.warning if outcome in ("corrupt", "mismatch", "failed") else log.info)("persistence: %s", line)
        return line

    def _restore(self) -> tuple[str, str]:
        try:
            with open_folder(self.folder) as fd:
                stale = remove_stale_temps(fd, self.file)
                if stale:
                    log.info("persistence: removed %d temp file(s) of an interrupted snapshot", stale)
                data = read_file(fd, self.file)
        except FileNotFoundError:
            return "none", f"no snapshot at {self.path}; starting empty"
        except UnsafePath as exc:
            return "failed", str(exc)
        try:
            snap = decode_snapshot(data)
            check_identity(snap, self.identity)
            done = self.engine.call(lambda: apply(snap, self.vocab, self.adapter)).result(CALL_TIMEOUT_S)
        except SnapshotError as exc:
            self._reject()
            return exc.kind, f"{self.path}: {exc}; ignored (kept as {self.file}.rejected), starting empty"
        self._last_signature = snap.signature()
        age = max(0.0, self._clock() - snap.created)
        parts = [f"ARC buffer {done['arc_size']} ids"] if done["arc_size"] is not None else []
        parts += [f"{done['adapter_keys']} adapter key(s)"] if self.adapter is not None else []
        return "restored", f"{self.path} ({', '.join(parts) or 'nothing kept'}; taken {age / 60:.1f} min ago)"

    def _reject(self) -> None:
        try:
            with open_folder(self.folder) as fd:
                os.replace(self.file, f"{self.file}.rejected", src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            log.warning("persistence: could not set the refused snapshot aside: %s", exc)

    # -- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> bool:
        """Capture at the engine's next safe point and write (skipped when nothing changed);
        True when the file on disk holds the state now. Never raises."""
        with self._writing:
            t0 = time.perf_counter()
            try:
                fut = self.engine.call(lambda: capture(self.identity, self.vocab, self.adapter))
                snap = fut.result(CALL_TIMEOUT_S)
                sig = snap.signature()
                if sig == self._last_signature:
                    with self._lock:
                        self._status["unchanged"] += 1
                    return True
                data = encode_snapshot(snap)
                write_snapshot_file(self.folder, self.file, data)
            except Exception as exc:
                with self._lock:
                    self._status["failures"] += 1
                    self._status["last_error"] = {
                        "time": self._clock(),
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                log.warning("persistence: snapshot to %s failed (%s); the previous one stays", self.path, exc)
                return False
            self._last_signature = sig
            with self._lock:
                self._status["snapshots"] += 1
                self._status["last_snapshot"] = {
                    "time": snap.created,
                    "bytes": len(data),
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            return True

    def start(self) -> None:
        """Snapshot every ``interval_s`` seconds on a background thread (none when 0)."""
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._every, name="evospec-snapshots", daemon=True)
        self._thread.start()

    def _every(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.snapshot()

    def close(self) -> bool:
        """Stop the timer and take the shutdown snapshot (after the engine stopped, ideally);
        :meth:`snapshot`'s answer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CALL_TIMEOUT_S)
            self._thread = None
        return self.snapshot()


def keeper_for(
    config: Any, engine: Engine, model_name: str, model: torch.nn.Module, head
) -> StateKeeper | None:
    """The keeper a server built from ``config`` (a ``ServeConfig``) needs; None when
    ``persist_state`` is off or the method learns nothing worth keeping."""
    from evospec.common import evospec_home
    from evospec.decoding.methods import method_spec

    spec = method_spec(engine.method)
    keep_arc = spec.has_arc and config.vocab.persist and engine.vocab is not None
    if not config.persist_state or not (keep_arc or engine.adapter is not None):
        return None
    folder = Path(config.state_dir).expanduser() if config.state_dir else evospec_home() / "state"
    ident = Identity.of(engine.method, model_name, model, head)
    return StateKeeper(engine, ident, folder, interval_s=60.0 * config.snapshot_minutes, keep_arc=keep_arc)


# -- where the admin API finds it -------------------------------------------------------------------
def attach(app: Any, keeper: StateKeeper | None) -> None:
    """Make ``keeper`` the app's (``/admin/state`` reports it)."""
    app.state.persistence = keeper


def attached(app: Any) -> StateKeeper | None:
    return getattr(app.state, "persistence", None)

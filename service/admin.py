"""Admin API: engine, vocabulary and adapter state, and the controls that steer them.

Owns: bearer-token auth for ``/admin/*`` (token from ``EVOSPEC_ADMIN_TOKEN``, compared with
``hmac.compare_digest``; no token configured -> every admin route answers 404 "disabled";
missing or wrong token -> 401) and the routes:
- ``GET /admin/state`` -- method, model, engine counters, and the vocabulary / ARC / OOV,
  adaptation and persistence (restart snapshots) sections (measured; null where the method has
  no such state).
- ``GET /admin/vocab`` (``?ids=true`` adds the ARC lists) -- the decoder's active vocabulary
  now; ``POST /admin/vocab/reset`` -- empties the ARC buffer (evospec, nanospec+evospec) and
  drops in-flight retrievals. Both 409 for a method without such state.
- ``GET /admin/adapter`` -- the online adapter (clora, osd, evospec-full): mode, versions per
  key, counters, auxiliary memory; ``POST /admin/adapter/reset {"key"?, "all"?}`` -- back to
  the base head; ``POST /admin/adapter/save {"name"?, "key"?}`` -- safetensors + metadata as
  ``<name>.safetensors`` in the adapter folder (default name ``<model>.<method>[.<key>]``);
  ``POST /admin/adapter/load {"name", "key"?}`` -- install and publish (404 no such file in the
  folder, 400 a file for another mode / rank / head); ``POST /admin/adaptation {"enabled":
  bool}`` -- pause or resume learning (the current adapter keeps serving). All 409 for other
  methods.

Adapter files: clients give names, never paths. The folder is ``adapter_dir`` of the serve
config, else ``$EVOSPEC_HOME/adapters``; a name must pass :func:`evospec.files.check_name` (a
``.safetensors`` suffix is allowed and dropped), else 400 ``invalid_path`` before the file
system is touched (``path`` is still accepted, as a bare name only). Files are opened relative
to the folder's descriptor with ``O_NOFOLLOW`` (``evospec/files.py``): a symlinked folder is
refused (500 ``adapter_folder_unsafe``), a symlink or folder under a name is never replaced,
and every load of a name that is not a regular file in the folder answers the same 404.
Writes are atomic. The bytes are made on the engine thread (a consistent copy) and written,
read and parsed on a worker thread, so the engine never waits for the disk.

Vocabulary and adapter state belong to the engine thread: it is read and reset through
:meth:`~service.engine.Engine.call`, at the engine's next safe point (between two rounds of
the running request, or while idle), never from the handler's thread.
"""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from evospec.adapt.online import OnlineAdapter
from evospec.decoding.methods import METHOD_SPECS, method_spec
from evospec.files import (
    NAME_RULE,
    UnsafeFolder,
    UnsafeName,
    check_name,
    open_folder,
    plain_name,
    read_file,
    write_atomic,
)
from evospec.vocab.active import ActiveVocab
from service import persistence
from service.context import ServiceContext
from service.engine import EngineSnapshot
from service.errors import SERVER_ERROR, APIError
from service.schemas import parse_body

ADMIN_TOKEN_ENV = "EVOSPEC_ADMIN_TOKEN"
CONTROL_TIMEOUT_S = 10.0  # longest wait for the engine's next safe point
ARC_METHODS = tuple(s.name for s in METHOD_SPECS.values() if s.has_arc)  # for messages


class _AdminBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class EmptyBody(_AdminBody):
    pass


_KEY = Field(default=None, min_length=1, max_length=256)  # adapter scope; None: the default state


class AdapterResetBody(_AdminBody):
    key: str | None = _KEY
    all: bool = False


class AdapterSaveBody(_AdminBody):
    name: str | None = None  # a file in the adapter folder; None: <model>.<method>[.<key>]
    path: str | None = None  # the old spelling of ``name``: a bare name only
    key: str | None = _KEY


class AdapterLoadBody(_AdminBody):
    name: str | None = None  # required (or ``path``)
    path: str | None = None
    key: str | None = _KEY


ADAPTER_SUFFIX = ".safetensors"


class AdaptationBody(_AdminBody):
    enabled: bool


def router(ctx: ServiceContext) -> APIRouter:
    r = APIRouter(prefix="/admin")

    def authorize(request: Request) -> None:
        if not ctx.admin_token:
            raise APIError(
                404,
                f"the admin API is disabled: set {ADMIN_TOKEN_ENV} to enable it",
                code="admin_disabled",
            )
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(
                401,
                "missing admin token: send 'Authorization: Bearer <token>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(given.strip().encode(), ctx.admin_token.encode()):
            raise APIError(
                401, "incorrect admin token", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
            )

    async def on_engine(fn: Any, what: str) -> Any:
        """``fn()`` on the engine thread; 503 when no safe point comes in time."""
        fut = ctx.engine.call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), CONTROL_TIMEOUT_S)
        except TimeoutError:
            fut.cancel()  # never runs later if it has not started
            raise APIError(
                503,
                f"{what}: the engine reached no safe point within {CONTROL_TIMEOUT_S:g} s (a round or a "
                "prefill is taking that long); try again",
                type=SERVER_ERROR,
                code="engine_busy",
            ) from None

    @r.get("/state")
    async def state(request: Request) -> dict[str, Any]:
        authorize(request)
        vocab = ctx.engine.vocab
        summary = None if vocab is None else await on_engine(lambda: vocab_summary(vocab), "state")
        keeper = persistence.attached(request.app)
        return {**admin_state(ctx, summary), "persistence": persistence_section(keeper)}

    @r.get("/vocab")
    async def vocab_state(request: Request) -> dict[str, Any]:
        authorize(request)
        ids = _flag(request, "ids")
        vocab = _require_vocab(ctx)
        summary = await on_engine(lambda: vocab_summary(vocab, ids=ids), "vocab")
        return {"method": ctx.engine.method, **summary}

    @r.get("/adapter")
    async def adapter_state(request: Request) -> dict[str, Any]:
        authorize(request)
        adapter = _require_adapter(ctx)
        return {"method": ctx.engine.method, **await on_engine(adapter.state, "adapter")}

    @r.post("/adapter/reset")
    async def adapter_reset(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await parse_body(request, AdapterResetBody, allow_empty=True) or AdapterResetBody()
        adapter = _require_adapter(ctx)
        done = await on_engine(lambda: adapter.reset(body.key, all_keys=body.all), "adapter reset")
        return {"method": ctx.engine.method, **done}

    @r.post("/adapter/save")
    async def adapter_save(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await parse_body(request, AdapterSaveBody, allow_empty=True) or AdapterSaveBody()
        name = _adapter_name(body) or default_adapter_name(ctx.model.name, ctx.engine.method, body.key)
        adapter = _require_adapter(ctx)
        data = await on_engine(lambda: adapter.export(body.key), "adapter save")
        folder = adapter_folder(ctx)
        try:
            await asyncio.to_thread(_write_adapter_file, folder, name + ADAPTER_SUFFIX, data)
        except UnsafeName as exc:  # something other than a regular file sits under that name
            raise APIError(400, str(exc), param="name", code="invalid_path") from None
        except UnsafeFolder as exc:
            raise _folder_error(exc) from None
        except OSError as exc:
            raise APIError(
                500,
                f"cannot write adapter {name!r} to the adapter folder: {exc.strerror or exc}",
                type=SERVER_ERROR,
                code="adapter_write_failed",
            ) from None
        return {
            "method": ctx.engine.method,
            "name": name,
            "path": str(folder / (name + ADAPTER_SUFFIX)),
            "key": body.key or "default",
        }

    @r.post("/adapter/load")
    async def adapter_load(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await parse_body(request, AdapterLoadBody)
        name = _adapter_name(body)
        if name is None:
            raise APIError.bad_request("give the adapter's name", param="name", code="missing")
        adapter = _require_adapter(ctx)
        try:
            data = await asyncio.to_thread(_read_adapter_file, adapter_folder(ctx), name + ADAPTER_SUFFIX)
        except UnsafeFolder as exc:
            raise _folder_error(exc) from None
        except FileNotFoundError:  # missing, a symlink, a folder, a FIFO: one answer for all
            raise APIError(
                404, f"no adapter named {name!r} in the adapter folder", code="adapter_not_found"
            ) from None
        except OSError as exc:
            raise APIError(
                500,
                f"cannot read adapter {name!r}: {exc.strerror or exc}",
                type=SERVER_ERROR,
                code="adapter_read_failed",
            ) from None
        try:
            tensors = await asyncio.to_thread(adapter.parse, data, name)
            info = await on_engine(lambda: adapter.install(tensors, body.key), "adapter load")
        except ValueError as exc:  # wrong mode / rank / head / tensors, or not a safetensors file
            raise APIError(400, f"cannot load adapter {name!r}: {exc}", code="invalid_adapter") from None
        return {"method": ctx.engine.method, "name": name, **info}

    @r.post("/vocab/reset")
    async def vocab_reset(request: Request) -> dict[str, Any]:
        authorize(request)
        await parse_body(request, EmptyBody, allow_empty=True)
        vocab = _require_vocab(ctx)
        if not method_spec(ctx.engine.method).has_arc:
            raise APIError(
                409,
                f"method {ctx.engine.method} keeps no dynamic vocabulary to reset (only "
                f"{', '.join(ARC_METHODS)} have an ARC buffer; nanospec's window restarts with "
                "every request)",
                code="no_dynamic_vocabulary",
            )
        return {"method": ctx.engine.method, **await on_engine(lambda: reset_dynamic(vocab), "vocab reset")}

    @r.post("/adaptation")
    async def adaptation(request: Request) -> dict[str, Any]:
        authorize(request)
        body = await parse_body(request, AdaptationBody)
        adapter = _require_adapter(ctx)

        def switch() -> dict[str, Any]:
            adapter.enabled = body.enabled
            return {"enabled": adapter.enabled}

        return {"method": ctx.engine.method, **await on_engine(switch, "adaptation switch")}

    return r


def _require_adapter(ctx: ServiceContext) -> OnlineAdapter:
    if ctx.engine.adapter is None:
        raise APIError(
            409,
            f"method {ctx.engine.method} does not adapt its draft online (serve clora, osd or evospec-full)",
            code="no_adapter",
        )
    return ctx.engine.adapter


def adapter_folder(ctx: ServiceContext) -> Path:
    """Where admin adapter files live: ``adapter_dir`` of the serve config, else
    ``$EVOSPEC_HOME/adapters``."""
    from evospec.common import evospec_home

    configured = ctx.config.adapter_dir
    return Path(configured).expanduser() if configured else evospec_home() / "adapters"


def _adapter_name(body: AdapterSaveBody | AdapterLoadBody) -> str | None:
    """The file stem a body names (``name``, or a bare-name ``path``); None when it names none.
    400 ``invalid_path`` for anything that is not a plain name."""
    if body.name is not None and body.path is not None:
        raise APIError(
            400, "give the adapter's name, not both name and path", param="name", code="invalid_path"
        )
    param, given = ("path", body.path) if body.path is not None else ("name", body.name)
    if given is None:
        return None
    try:
        return check_name(given.removesuffix(ADAPTER_SUFFIX))
    except UnsafeName:
        where = " (paths are not accepted: adapter files live in the server's adapter folder)"
        raise APIError(
            400,
            f"{param} {given!r} is not a plain name: {NAME_RULE}{where if param == 'path' else ''}",
            param=param,
            code="invalid_path",
        ) from None


def default_adapter_name(model: str, method: str, key: str | None) -> str:
    """``<model>.<method>[.<key>]``, made a plain name (``evospec/files.py: plain_name``)."""
    return plain_name(".".join(p for p in (model, method, key) if p))


def _write_adapter_file(folder: Path, file: str, data: bytes) -> None:
    with open_folder(folder, create=True) as fd:
        write_atomic(fd, file, data)


def _read_adapter_file(folder: Path, file: str) -> bytes:
    with open_folder(folder) as fd:
        return read_file(fd, file)


def _folder_error(exc: UnsafeFolder) -> APIError:
    return APIError(500, f"adapter folder refused: {exc}", type=SERVER_ERROR, code="adapter_folder_unsafe")


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise APIError.bad_request(f"query parameter {name} must be true or false, got {raw!r}", param=name)
    return raw in ("true", "1")


def _require_vocab(ctx: ServiceContext) -> ActiveVocab:
    if ctx.engine.vocab is None:
        raise APIError(
            409,
            f"method {ctx.engine.method} has no draft vocabulary (it does not draft); serve a speculative "
            "method to inspect or reset one",
            code="no_draft_vocabulary",
        )
    return ctx.engine.vocab


# -- run on the engine thread (Engine.call) -------------------------------------------------------
def vocab_summary(vocab: ActiveVocab, *, ids: bool = False) -> dict[str, Any]:
    """The active vocabulary now: sizes, and the ARC lists' sizes (+ ids when asked) and ``p``."""
    st = vocab.state()
    out: dict[str, Any] = {
        "policy": st["policy"],  # "full" for eagle2
        "active_size": st["active_size"],  # ids the draft could propose in the last round
        "capacity": st["capacity"],  # most ids ever active (the reduced head's slots)
        "static_size": st.get("static_size"),  # frspec, evospec: the frequency table
        "window": st.get("window"),  # nanospec(+evospec): stream entries kept
        "window_size": st.get("window_size"),  # ... and the unique ids among them
        "arc": None,
        "pending_retrievals": st.get("pending_retrievals"),
    }
    if "arc" in st:
        arc = st["arc"]
        out["arc"] = {
            "capacity": arc["config"]["capacity"],
            "ghost_capacity": arc["config"]["ghost_capacity"],
            "size": st["arc_size"],
            "t1": len(arc["t1"]),
            "t2": len(arc["t2"]),
            "b1": len(arc["b1"]),
            "b2": len(arc["b2"]),
            "p": arc["p"],
            "events": arc["events"],  # retrieval results admitted (one per merged OOV event)
            "clock": arc["clock"],  # rounds seen
            "persist": st["persist"],
        }
        if ids:  # least recently used first
            out["arc"]["ids"] = {
                "t1": [tok for tok, _ in arc["t1"]],
                "t2": [tok for tok, _ in arc["t2"]],
                "b1": list(arc["b1"]),
                "b2": list(arc["b2"]),
            }
    return out


def reset_dynamic(vocab: ActiveVocab) -> dict[str, Any]:
    """Empty the ARC buffer (lists, ``p`` back to its initial value) and drop in-flight retrievals."""
    cleared = vocab.reset_dynamic()
    return {"reset": True, "cleared": cleared, "vocabulary": vocab_summary(vocab)}


# -- /admin/state -----------------------------------------------------------------------------------
def admin_state(ctx: ServiceContext, vocab: dict[str, Any] | None) -> dict[str, Any]:
    """``vocab``: :func:`vocab_summary` taken on the engine thread (None without a draft)."""
    s = ctx.engine.snapshot()
    return {
        "model": ctx.model.name,
        "method": s.method,
        "context_window": ctx.model.context_window,
        "engine": {
            "alive": s.alive,
            "active": s.active,
            "running": s.running,
            "max_batch": s.max_batch,
            "queue_depth": s.queue_depth,
            "max_queue": s.max_queue,
            "idle_work": s.idle_work,  # e.g. --method auto still timing its candidates; null: none
            "submitted": s.submitted,
            "rejected": s.rejected,
            "outcomes": s.outcomes,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.stats.tokens,
            "rounds": s.stats.rounds,
            "accepted_tokens": s.stats.accepted,
            "mal": s.stats.mal,
        },
        **_vocab_sections(ctx, s, vocab),
        "adaptation": adaptation_section(ctx),
    }


def persistence_section(keeper: persistence.StateKeeper | None) -> dict[str, Any]:
    """Restart snapshots: what the start-up restore found, the last snapshot and its errors."""
    if keeper is None:
        return {
            "enabled": False,
            "note": "no restart snapshots (persist_state off, nothing this method learns, or not served "
            "by evospec serve)",
        }
    return {"note": None, **keeper.status()}


def adaptation_section(ctx: ServiceContext) -> dict[str, Any]:
    """The online adapter's headline numbers (read without the engine thread: plain counters)."""
    a = ctx.engine.adapter
    if a is None:
        return {
            "implemented": True,
            "note": f"method {ctx.engine.method} does not adapt its draft online",
            "mode": None,
            "enabled": False,
            "adapter_version": None,
            "keys": None,
            "update_count": None,
            "discarded_updates": None,
            "last_loss": None,
            "replay_fill": None,
        }
    versions = a.versions()
    return {
        "implemented": True,
        "note": None,
        "mode": a.mode,
        "enabled": a.enabled,
        "adapter_version": versions.get("", 0),
        "keys": len(versions),
        "update_count": a.stats.updates,
        "discarded_updates": a.stats.discarded,
        "last_loss": a.stats.losses[-1] if a.stats.losses else None,
        "replay_fill": a.buffered(),
    }


_SECTION_KEYS = {
    "vocabulary": (
        "policy",
        "active_vocab_size",
        "capacity",
        "static_size",
        "window",
        "window_size",
        "mean_active_vocab_size",
        "verified_tokens",
        "covered_tokens",
        "coverage",
    ),
    "arc": ("t1", "t2", "b1", "b2", "p", "capacity", "size", "pending_retrievals"),
    "oov": (
        "events_total",
        "retrievals",
        "retrievals_late",
        "retrieval_errors",
        "retrievals_dropped",
        "mean_retrieval_s",
        "recent_events",
    ),
}


def _vocab_sections(ctx: ServiceContext, s: EngineSnapshot, vocab: dict[str, Any] | None) -> dict[str, Any]:
    """The ``vocabulary``, ``arc`` and ``oov`` sections (fields null where the method has none)."""
    if vocab is None:
        note = f"method {s.method} has no draft vocabulary"
        return {
            name: {"implemented": True, "note": note, **dict.fromkeys(keys)}
            for name, keys in _SECTION_KEYS.items()
        }
    v = s.stats.vocab
    arc = vocab["arc"]
    if arc is None:
        arc_section = {
            "note": f"method {s.method} keeps no ARC buffer (only {', '.join(ARC_METHODS)} do)",
            **dict.fromkeys(_SECTION_KEYS["arc"]),
        }
    else:
        arc_section = {
            "note": None,
            **{k: arc[k] for k in ("t1", "t2", "b1", "b2", "p", "capacity", "size")},
            "pending_retrievals": vocab["pending_retrievals"],
        }
    return {
        "vocabulary": {
            "implemented": True,
            "note": None,
            "policy": vocab["policy"],
            "active_vocab_size": vocab["active_size"],  # the last round's
            "capacity": vocab["capacity"],
            "static_size": vocab["static_size"],
            "window": vocab["window"],
            "window_size": vocab["window_size"],
            "mean_active_vocab_size": v.mean_active_size,  # over every round since start
            "verified_tokens": v.verified,
            "covered_tokens": v.covered,
            "coverage": v.coverage,
        },
        "arc": {"implemented": True, **arc_section},
        "oov": {
            "implemented": True,
            "note": None,
            "events_total": v.oov_events,
            "retrievals": v.retrievals,
            "retrievals_late": v.late,
            "retrieval_errors": v.errors,
            "retrievals_dropped": v.dropped,
            "mean_retrieval_s": v.retrieval_s / v.retrievals if v.retrievals else None,
            "recent_events": [
                {
                    "request_id": e.request_id,
                    "round": e.round,
                    "token": e.token,
                    "text": None if e.token is None else ctx.model.codec.decode([e.token]),
                    "time": e.time,
                }
                for e in s.recent_oov
            ],
        },
    }

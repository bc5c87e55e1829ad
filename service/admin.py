"""Admin API: engine, vocabulary and adapter state, and the controls that steer them.

Owns: bearer-token auth for ``/admin/*`` (token from ``EVOSPEC_ADMIN_TOKEN``, compared with
``hmac.compare_digest``; no token configured -> every admin route answers 404 "disabled";
missing or wrong token -> 401) and the routes:
- ``GET /admin/state`` -- method, model, engine counters, and the vocabulary / ARC / OOV
  sections (measured) and the adaptation section (``"implemented": false``: online LoRA does
  not exist yet, so its fields are null instead of invented numbers).
- ``GET /admin/vocab`` (``?ids=true`` adds the ARC lists) -- the decoder's active vocabulary
  now; ``POST /admin/vocab/reset`` -- empties the ARC buffer (evospec, nanospec+evospec) and
  drops in-flight retrievals. Both 409 for a method without such state.
- ``POST /admin/adapter/{reset,save,load}``, ``POST /admin/adaptation {"enabled": bool}`` --
  authenticated and body-validated, then ``501 not_implemented`` until LoRA adaptation lands.

Vocabulary state belongs to the engine thread: it is read and reset through
:meth:`~service.engine.Engine.call`, at the engine's next safe point (between two rounds of
the running request, or while idle), never from the handler's thread.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from evospec.vocab.active import ActiveVocab
from service.context import ServiceContext
from service.engine import EngineSnapshot
from service.errors import SERVER_ERROR, APIError
from service.schemas import parse_body

ADMIN_TOKEN_ENV = "EVOSPEC_ADMIN_TOKEN"
ADAPT_NOTE = "not implemented yet: online LoRA adaptation (evospec/adapt) does not exist"
CONTROL_TIMEOUT_S = 10.0  # longest wait for the engine's next safe point
ARC_METHODS = ("evospec", "nanospec+evospec")  # methods whose policy keeps an ARC buffer


class _AdminBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class EmptyBody(_AdminBody):
    pass


class AdapterSaveBody(_AdminBody):
    path: str | None = Field(default=None, min_length=1)  # None: the default adapter location


class AdapterLoadBody(_AdminBody):
    path: str = Field(..., min_length=1)


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
        return admin_state(ctx, summary)

    @r.get("/vocab")
    async def vocab_state(request: Request) -> dict[str, Any]:
        authorize(request)
        ids = _flag(request, "ids")
        vocab = _require_vocab(ctx)
        summary = await on_engine(lambda: vocab_summary(vocab, ids=ids), "vocab")
        return {"method": ctx.engine.method, **summary}

    @r.post("/adapter/reset")
    async def adapter_reset(request: Request) -> None:
        authorize(request)
        await parse_body(request, EmptyBody, allow_empty=True)
        raise _not_implemented("adapter reset", ADAPT_NOTE)

    @r.post("/adapter/save")
    async def adapter_save(request: Request) -> None:
        authorize(request)
        await parse_body(request, AdapterSaveBody, allow_empty=True)
        raise _not_implemented("adapter save", ADAPT_NOTE)

    @r.post("/adapter/load")
    async def adapter_load(request: Request) -> None:
        authorize(request)
        await parse_body(request, AdapterLoadBody)
        raise _not_implemented("adapter load", ADAPT_NOTE)

    @r.post("/vocab/reset")
    async def vocab_reset(request: Request) -> dict[str, Any]:
        authorize(request)
        await parse_body(request, EmptyBody, allow_empty=True)
        vocab = _require_vocab(ctx)
        if not _has_arc(vocab):
            raise APIError(
                409,
                f"method {ctx.engine.method} keeps no dynamic vocabulary to reset (only "
                f"{' and '.join(ARC_METHODS)} have an ARC buffer; nanospec's window restarts with "
                "every request)",
                code="no_dynamic_vocabulary",
            )
        return {"method": ctx.engine.method, **await on_engine(lambda: reset_dynamic(vocab), "vocab reset")}

    @r.post("/adaptation")
    async def adaptation(request: Request) -> None:
        authorize(request)
        await parse_body(request, AdaptationBody)
        raise _not_implemented("switching adaptation", ADAPT_NOTE)

    return r


def _not_implemented(what: str, note: str) -> APIError:
    return APIError(501, f"{what}: {note}", type="not_implemented_error", code="not_implemented")


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


def _has_arc(vocab: ActiveVocab) -> bool:
    """Whether the policy keeps an ARC buffer (evospec, nanospec+evospec)."""
    return vocab.policy is not None and "arc" in vocab.policy.state()


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
            "queue_depth": s.queue_depth,
            "max_queue": s.max_queue,
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
        "adaptation": {
            "implemented": False,
            "note": ADAPT_NOTE,
            "enabled": False,
            "adapter_version": None,
            "update_count": None,
            "last_loss": None,
            "replay_fill": None,
        },
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
            "note": f"method {s.method} keeps no ARC buffer (only {' and '.join(ARC_METHODS)} do)",
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

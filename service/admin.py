"""Admin API: engine, vocabulary and adapter state, and the controls that will steer them.

Owns: bearer-token auth for ``/admin/*`` (token from ``EVOSPEC_ADMIN_TOKEN``, compared with
``hmac.compare_digest``; no token configured -> every admin route answers 404 "disabled";
missing or wrong token -> 401) and the routes:
- ``GET /admin/state`` -- method, model, engine counters, and the vocabulary / ARC / OOV /
  adaptation sections. Those features do not exist yet, so each of those sections carries
  ``"implemented": false`` and a note, and its fields are null instead of invented numbers.
- ``POST /admin/adapter/{reset,save,load}``, ``POST /admin/vocab/reset``,
  ``POST /admin/adaptation {"enabled": bool}`` -- authenticated and body-validated, then
  ``501 not_implemented`` until the features land.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from service.context import ServiceContext
from service.errors import APIError
from service.schemas import parse_body

ADMIN_TOKEN_ENV = "EVOSPEC_ADMIN_TOKEN"
VOCAB_NOTE = (
    "not implemented yet: no active-vocabulary policy exists (evospec/vocab); the draft, if any, "
    "proposes over the full vocabulary"
)
ARC_NOTE = "not implemented yet: the ARC buffer (T1/T2/B1/B2, p) arrives with the EvoSpec vocabulary policy"
OOV_NOTE = "not implemented yet: OOV events are recorded once an active vocabulary exists"
ADAPT_NOTE = "not implemented yet: online LoRA adaptation (evospec/adapt) does not exist"


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

    @r.get("/state")
    async def state(request: Request) -> dict[str, Any]:
        authorize(request)
        return admin_state(ctx)

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
    async def vocab_reset(request: Request) -> None:
        authorize(request)
        await parse_body(request, EmptyBody, allow_empty=True)
        raise _not_implemented("vocabulary reset", VOCAB_NOTE)

    @r.post("/adaptation")
    async def adaptation(request: Request) -> None:
        authorize(request)
        await parse_body(request, AdaptationBody)
        raise _not_implemented("switching adaptation", ADAPT_NOTE)

    return r


def _not_implemented(what: str, note: str) -> APIError:
    return APIError(501, f"{what}: {note}", type="not_implemented_error", code="not_implemented")


def admin_state(ctx: ServiceContext) -> dict[str, Any]:
    s = ctx.engine.snapshot()
    drafts = s.method != "ar"
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
        "vocabulary": {
            "implemented": False,
            "note": VOCAB_NOTE,
            "policy": "full" if drafts else None,
            "active_vocab_size": ctx.model.vocab_size if drafts else None,
        },
        "arc": {
            "implemented": False,
            "note": ARC_NOTE,
            "t1": None,
            "t2": None,
            "b1": None,
            "b2": None,
            "p": None,
        },
        "oov": {"implemented": False, "note": OOV_NOTE, "events_total": None, "recent_events": None},
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

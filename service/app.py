"""The FastAPI application factory.

Owns: :func:`create_app` -- wires an already-built :class:`~service.engine.Engine` and
:class:`~service.context.ServedModel` into routes (OpenAI API, admin API, ``/health``,
``/metrics``), OpenAI-style error handlers, the middleware stack (response counter, catch-all
500, body limits), the OpenAPI schema of the JSON bodies (routes parse them themselves, so
FastAPI cannot see them), and a lifespan that starts the engine thread with the server and
stops it on shutdown. Loading models is not its business (see ``server.py``),
so tests hand it tiny models and instrumented decoders.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service import admin, openai_api
from service.config import ServeConfig
from service.context import ServedModel, ServiceContext
from service.engine import Engine
from service.errors import CatchAll, install_handlers
from service.limits import BodyLimits
from service.metrics import ServiceMetrics


def create_app(engine: Engine, model: ServedModel, config: ServeConfig) -> FastAPI:
    """An app serving ``model`` through ``engine``; the admin token is read from the environment now."""
    ctx = ServiceContext(
        engine=engine,
        model=model,
        config=config,
        metrics=ServiceMetrics(engine),
        admin_token=os.environ.get(admin.ADMIN_TOKEN_ENV) or None,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="EvoSpec", version="0.1.0", lifespan=lifespan)
    app.state.ctx = ctx
    install_handlers(app)
    app.include_router(openai_api.router(ctx))
    app.include_router(admin.router(ctx))

    @app.get("/health")
    async def health() -> JSONResponse:
        s = engine.snapshot()
        body = {
            "status": "ok" if s.alive else "engine_stopped",
            "model": model.name,
            "method": s.method,
            "idle_work": s.idle_work,  # e.g. "method auto: timing the candidates"; null: none
            "queue_depth": s.queue_depth,
            "active": s.active,
            "running": s.running,
        }
        return JSONResponse(body, status_code=200 if s.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # outermost last: counter -> catch-all 500 -> body limits -> FastAPI's handlers -> routes
    app.add_middleware(
        BodyLimits, max_body_bytes=config.max_body_bytes, read_timeout_s=config.body_read_timeout
    )
    app.add_middleware(CatchAll)
    app.add_middleware(_ResponseCounter, metrics=ctx.metrics)
    app.openapi = lambda: _openapi_with_bodies(app, model.name)  # type: ignore[method-assign]
    return app


def _openapi_with_bodies(app: FastAPI, served_name: str) -> dict[str, Any]:
    """FastAPI's schema plus the request body of each route that parses its own JSON."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in openai_api.REQUEST_BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            body["properties"]["model"]["enum"] = [served_name]  # anything else is 404 model_not_found
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        app.openapi_schema = schema
    return app.openapi_schema


class _ResponseCounter:
    """Pure ASGI middleware counting responses by route template and status code.

    (Pure ASGI rather than ``BaseHTTPMiddleware``, which would interfere with streaming
    responses and disconnect detection.)
    """

    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counting_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.http.labels(route=path, code=str(status["code"])).inc()

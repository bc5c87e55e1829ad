"""OpenAI-style errors: one exception type, one JSON shape, and the app's exception handlers.

Owns: :class:`APIError` (status + ``{"error": {"message", "type", "param", "code"}}``) with
constructors for the common cases, :func:`install_handlers`, which turns the errors routes
raise into that shape -- our own ``APIError``, FastAPI/Starlette routing errors (404, 405) and
request validation -- and :class:`CatchAll`, the middleware that answers any unexpected
exception with a 500 that names no internals, logged once. Every 500 carries
``Connection: close``, so a keep-alive client opens a fresh connection instead of reusing one
the server may drop. Client mistakes never reach the 500 path: handlers raise ``APIError``
with a 4xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("evospec.service")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error response: HTTP ``status`` and the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return error_response(self.body(), self.status, self.headers)

    @classmethod
    def bad_request(cls, message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unsupported(cls, param: str, what: str) -> APIError:
        return cls(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object; ``message`` and ``param`` may quote the request, so lone
    surrogates in them are escaped (``\\ud800``) to keep the body encodable as UTF-8."""
    return {"error": {"message": _utf8_safe(message), "type": type, "param": _utf8_safe(param), "code": code}}


def error_response(body: dict[str, Any], status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    """``body`` as JSON; a 500 also says ``Connection: close``."""
    headers = dict(headers or {})
    if status == 500:
        headers["Connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers)


def _utf8_safe(text: str | None) -> str | None:
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def install_handlers(app: FastAPI) -> None:
    """Exception handlers giving the errors routes raise an OpenAI-style JSON body (the
    unexpected ones are :class:`CatchAll`'s)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            msg, code = f"no route {request.method} {request.url.path}", "not_found"
        elif exc.status_code == 405:
            msg, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            msg, code = str(exc.detail), None
        typ = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
        return error_response(error_body(msg, type=typ, code=code), exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(first.get("msg", "invalid request"), param=param), status_code=400)


class CatchAll:
    """Pure ASGI middleware: an exception no handler took becomes a 500 in the OpenAI shape.

    It sits inside Starlette's ``ServerErrorMiddleware``, which would answer too but then
    re-raise, so uvicorn would log the failure a second time and drop the connection under a
    keep-alive client. Here the failure is logged once and the 500 says ``Connection: close``.
    When the response had already started (a stream broke), nothing can be sent any more: the
    exception goes on to uvicorn, which logs it and closes the connection. A client that went
    away while its body was being read is not a server error: nothing is logged or sent.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.debug("client disconnected during %s %s", scope["method"], scope["path"])
        except Exception:
            if started:
                raise
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            body = error_body("internal server error", type=SERVER_ERROR, code="internal_error")
            await error_response(body, 500)(scope, receive, send)

"""OpenAI-style errors: one exception type, one JSON shape, and the app's exception handlers.

Owns: :class:`APIError` (status + ``{"error": {"message", "type", "param", "code"}}``) with
constructors for the common cases, and :func:`install_handlers`, which turns every error the
app can meet into that shape -- our own ``APIError``, FastAPI/Starlette routing errors (404,
405) and request validation, and, last, any unexpected exception (a 500 that names no
internals). Client mistakes never reach the 500 path: handlers raise ``APIError`` with a 4xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def bad_request(cls, message: str, *, param: str | None = None, code: str = "invalid_value") -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unsupported(cls, param: str, what: str) -> APIError:
        return cls(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def install_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-style JSON body."""

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
        return JSONResponse(
            error_body(msg, type=typ, code=code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(first.get("msg", "invalid request"), param=param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body("internal server error", type=SERVER_ERROR, code="internal_error"), status_code=500
        )

"""Limits on reading a request: the size of its head, the size of its body and the time the
body may take to arrive.

Owns: :class:`BodyLimits`, a pure ASGI middleware. A request head (request line and headers)
over ``max_header_bytes`` is answered with 431 before anything else: uvicorn's own bound on a
head (h11's ``max_incomplete_event_size``, :data:`MAX_HEADER_BYTES` too) only holds while a head
is still arriving in pieces, and a head read in one go passes it whatever its size. A
``Content-Length`` above ``max_body_bytes`` is answered with 413 at once, before any of the body
is read; a chunked body is counted as it arrives and refused with 413 as soon as it passes the
limit. A body that has not fully arrived ``read_timeout_s`` seconds after the request's headers
(a client that sends less than its ``Content-Length`` and waits, or trickles) ends with 408 --
uvicorn has no such timeout: its keep-alive timer only runs between requests. These answers
close the connection, since the rest of the body may still be on its way. Before a 431 or a 413
for a declared length, what the client keeps sending is read and discarded (never kept: at most
:data:`DRAIN_MAX_BYTES`, until it pauses for :data:`DRAIN_IDLE_S` or the read timeout), so a
client that writes its whole body before reading gets the answer instead of a connection reset
(the kernel resets a socket closed with unread data; the soak saw 85 of 4,449 requests end so).
Knows nothing about routes or models: the limits apply to every request, and only bodies a
route actually reads are timed and counted.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import APIError

CLOSE = {"Connection": "close"}
MAX_HEADER_BYTES = 16 * 1024  # a request line and its headers, as written on the wire
DRAIN_MAX_BYTES = 64 * 1024 * 1024  # read and dropped before a 413; past it, answer and close
DRAIN_IDLE_S = 0.25  # a client that stops sending is answered after this pause


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
        headers=CLOSE,
    )


def head_too_large(size: int, limit: int) -> APIError:
    return APIError(
        431,
        f"the request line and headers take {size} bytes, over this server's limit of {limit}",
        code="request_header_fields_too_large",
        headers=CLOSE,
    )


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout", headers=CLOSE
    )


class BodyLimits:
    """431 for request heads over ``max_header_bytes``, 413 for bodies over ``max_body_bytes``,
    408 for bodies slower than ``read_timeout_s``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        read_timeout_s: float,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s
        head = _head_bytes(scope)
        refusal = None
        if head > self.max_header_bytes:
            refusal = head_too_large(head, self.max_header_bytes)
        elif declared is not None and declared > self.max_body_bytes:
            refusal = too_large(self.max_body_bytes)
        if refusal is not None:
            if not await _drain(receive, min(declared or 0, DRAIN_MAX_BYTES), deadline):
                return  # the client went away: nobody to answer
            await refusal.response()(scope, receive, send)
            return
        seen, complete = 0, False

        async def limited_receive() -> Message:
            """The body as uvicorn delivers it, counted and timed until its last chunk; after
            that (disconnect polling) ``receive`` unchanged."""
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                raise too_slow(self.read_timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise too_large(self.max_body_bytes)
                complete = not message.get("more_body", False)
            else:
                complete = True  # http.disconnect
            return message

        await self.app(scope, limited_receive, send)


async def _drain(receive: Receive, limit: int, deadline: float) -> bool:
    """Read and drop body chunks until the body ends, ``limit`` bytes, a pause of
    ``DRAIN_IDLE_S`` or ``deadline``; False if the client disconnected."""
    loop = asyncio.get_running_loop()
    drained = 0
    while drained < limit:
        wait = min(DRAIN_IDLE_S, deadline - loop.time())
        if wait <= 0:
            return True
        try:
            message = await asyncio.wait_for(receive(), wait)
        except TimeoutError:
            return True
        if message["type"] == "http.disconnect":
            return False
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return True


def _head_bytes(scope: Scope) -> int:
    """The request line and headers as sent: ``METHOD PATH?QUERY HTTP/1.1\\r\\n`` and ``name:
    value\\r\\n`` each (the path as sent, before percent-decoding)."""
    path = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string", b"")
    line = len(scope.get("method", "")) + 1 + len(path) + (1 + len(query) if query else 0) + 11
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses malformed lengths before the app sees the request
    return None

"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Owns: turning a validated request into a :class:`~service.engine.GenerationRequest` (prompt
encoding through ``prompting.py``, off the event loop; the context-window and ``max_tokens``
checks, sampling defaults as OpenAI's: temperature 1, top_p 1, ``max_tokens`` 16 for
completions and "up to the context" for chat),
submitting it, and shaping what comes back -- one JSON body, or Server-Sent Events ending in
``data: [DONE]``. Every response carries ``usage`` (streams: with
``stream_options.include_usage``), ``logprobs`` where asked (the target's raw distribution at
each token, ``decoding/logprobs.py``; chat: ``logprobs`` + ``top_logprobs``, completions: ``logprobs``
= alternatives per token), and an ``evospec`` object with the request's speculative
stats (method, rounds, accepted, MAL, draft coverage, mean active vocabulary size, OOV events).

Handlers never touch the model: they validate, enqueue and await the engine's events. A client
that disconnects (mid-stream or while waiting) cancels its request between rounds.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from evospec.decoding.events import StepEvent
from evospec.decoding.logprobs import TokenLogprob
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats
from service.context import ServiceContext
from service.engine import AsyncSink, Done, EngineBusy, EngineStopped, GenerationRequest, Outcome
from service.errors import SERVER_ERROR, APIError
from service.prompting import PromptEncoder
from service.schemas import ChatRequest, CompletionRequest, SamplingFields, parse_body
from service.textstream import TextAssembler

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_GRACE_S = 2.0  # the handler waits this much past the deadline for the engine's own timeout
_POLL_S = 0.5  # non-streaming handlers check for a client disconnect this often
NO_PROBABILITY = -9999.0  # the logprob OpenAI reports for a token of no probability
REQUEST_BODIES: dict[str, type[BaseModel]] = {  # for the OpenAPI schema (app.py)
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


@dataclass
class _Job:
    """One submitted request as its handler sees it."""

    request: GenerationRequest
    sink: AsyncSink
    text: TextAssembler
    stats: RequestStats
    ended: bool = False  # the handler saw the end (finish, stop string or error)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # tokens whose text was not sent yet
    offset: int = 0  # characters of token text reported so far (completions' ``text_offset``)


@dataclass(frozen=True)
class _Piece:
    """Text that may be sent now, the logprobs of the tokens consumed since the last piece
    (empty unless the request asked), and the finish reason at the end."""

    text: str
    finish: str | None
    logprobs: list[TokenLogprob]


def router(ctx: ServiceContext) -> APIRouter:
    r = APIRouter()
    encoder = PromptEncoder.for_model(ctx.model)

    @r.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(ctx)]}

    @r.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        _check_model(ctx, model_id)
        return _model_card(ctx)

    @r.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await parse_body(request, CompletionRequest)
        body.check_supported()
        _check_model(ctx, body.model)
        if isinstance(body.prompt, str):
            ids = await encoder.prompt(body.prompt)
        else:
            ids = body.prompt
            bad = [t for t in ids if not 0 <= t < ctx.model.vocab_size]
            if bad:
                raise APIError.bad_request(
                    f"token id {bad[0]} is outside the vocabulary (0..{ctx.model.vocab_size - 1})",
                    param="prompt",
                )
        job = _submit(ctx, body, ids, body.max_tokens, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt")
        return await _respond(ctx, job, body, request, chat=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await parse_body(request, ChatRequest)
        body.check_supported()
        _check_model(ctx, body.model)
        codec = ctx.model.codec
        if not codec.has_chat_template:
            raise APIError.bad_request(
                f"model '{ctx.model.name}' has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        ids = await encoder.chat(body.template_messages())
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        job = _submit(ctx, body, ids, body.requested_max_tokens, param, None, "messages")
        return await _respond(ctx, job, body, request, chat=True)

    return r


def _model_card(ctx: ServiceContext) -> dict[str, Any]:
    return {
        "id": ctx.model.name,
        "object": "model",
        "created": ctx.model.created,
        "owned_by": "evospec",
        "context_window": ctx.model.context_window,
        "method": ctx.engine.method,
    }


def _check_model(ctx: ServiceContext, name: str) -> None:
    if name != ctx.model.name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{ctx.model.name}'",
            param="model",
            code="model_not_found",
        )


# -- request -> engine ----------------------------------------------------------------------------
def _submit(
    ctx: ServiceContext,
    body: SamplingFields,
    ids: list[int],
    max_tokens: int | None,
    max_param: str,
    default_max: int | None,
    prompt_param: str,
) -> _Job:
    window, limit = ctx.model.context_window, ctx.config.max_tokens_limit
    if not ids:
        raise APIError.bad_request("the prompt is empty (no tokens)", param=prompt_param)
    room = window - len(ids)
    if room < 1:
        raise APIError.bad_request(
            f"This model's maximum context length is {window} tokens; the prompt has {len(ids)} tokens, "
            "leaving no room for a completion",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max or room, room, limit)
    elif max_tokens < 1:
        raise APIError.bad_request(f"{max_param} must be >= 1, got {max_tokens}", param=max_param)
    elif max_tokens > limit:
        raise APIError.bad_request(
            f"{max_param} is {max_tokens}, above this server's limit of {limit}", param=max_param
        )
    elif len(ids) + max_tokens > window:
        raise APIError.bad_request(
            f"This model's maximum context length is {window} tokens; you requested {len(ids) + max_tokens} "
            f"({len(ids)} in the prompt, {max_tokens} for the completion)",
            param=max_param,
            code="context_length_exceeded",
        )
    bad = [i for i, _ in body.penalties.bias if i >= ctx.model.vocab_size]
    if bad:
        raise APIError.bad_request(
            f"logit_bias names token id {bad[0]}, outside the vocabulary (0..{ctx.model.vocab_size - 1})",
            param="logit_bias",
        )
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            logprobs=body.requested_logprobs,
            penalties=body.penalties,
        )
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    key = body.user if ctx.config.adapt.scope == "user" else None
    request = GenerationRequest(ids, params, timeout_s=ctx.config.request_timeout, adapter_key=key)
    sink = AsyncSink()
    try:
        ctx.engine.submit(request, sink)
    except EngineBusy as exc:
        raise APIError(
            503,
            f"server busy: {exc.depth} requests are queued (limit {ctx.engine.max_queue}); "
            f"retry after {exc.retry_after_s} s",
            type=SERVER_ERROR,
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except EngineStopped:
        raise APIError(503, "the engine is not running", type=SERVER_ERROR, code="engine_stopped") from None
    return _Job(request, sink, TextAssembler(ctx.model.codec, body.stops), RequestStats())


async def _pieces(ctx: ServiceContext, job: _Job, client: Request | None) -> AsyncIterator[_Piece]:
    """Pieces until the end (the last has a finish reason); engine failures raise :class:`APIError`.

    ``client``: poll it for a disconnect while waiting (non-streaming requests).
    """
    req = job.request
    next_check = time.monotonic() + _POLL_S
    while True:
        now = time.monotonic()
        if client is not None and now >= next_check:
            next_check = now + _POLL_S
            if await client.is_disconnected():
                req.cancel(Outcome.DISCONNECTED)
                job.ended = True
                return
        remaining = req.deadline + _GRACE_S - now
        if remaining <= 0:
            req.cancel(Outcome.TIMEOUT)
            job.ended = True
            raise _timeout(ctx)
        try:
            item = await job.sink.get(min(remaining, max(next_check - now, 0.01)) if client else remaining)
        except TimeoutError:
            continue
        if isinstance(item, Done):
            job.ended = True
            _raise_for(ctx, item)
            tail = job.text.finish()  # the decoder ended without a finish reason (defensive)
            yield _take(job, tail.text, "stop")
            return
        assert isinstance(item, StepEvent)
        job.stats.add(item)
        used = job.text.tokens_used
        piece = job.text.push(item.tokens)
        if item.logprobs is not None:  # the tokens the text took (not those past a stop string)
            job.logprobs += item.logprobs[: job.text.tokens_used - used]
        if piece.stopped:
            req.cancel(Outcome.STOP_STRING)
            job.ended = True
            yield _take(job, piece.text, "stop")
            return
        if item.finish_reason is not None:
            tail = job.text.finish()
            job.ended = True
            yield _take(job, piece.text + tail.text, "stop" if tail.stopped else item.finish_reason)
            return
        if piece.text:
            yield _take(job, piece.text, None)


def _take(job: _Job, text: str, finish: str | None) -> _Piece:
    """A piece with the logprobs gathered since the last one."""
    piece = _Piece(text, finish, job.logprobs)
    job.logprobs = []
    return piece


def _raise_for(ctx: ServiceContext, done: Done) -> None:
    if done.outcome is Outcome.FAILED:
        raise APIError(500, f"generation failed: {done.error}", type=SERVER_ERROR, code="generation_failed")
    if done.outcome is Outcome.TIMEOUT:
        raise _timeout(ctx)
    if done.outcome is Outcome.SHUTDOWN:
        raise APIError(503, "the server is shutting down", type=SERVER_ERROR, code="shutting_down")


def _timeout(ctx: ServiceContext) -> APIError:
    return APIError(
        504,
        f"the request did not finish within the server's request_timeout of {ctx.config.request_timeout:g} s",
        type=SERVER_ERROR,
        code="timeout",
    )


# -- engine -> response ---------------------------------------------------------------------------
def spec_fields(method: str, stats: RequestStats) -> dict[str, Any]:
    """The ``evospec`` object of a response: this request's speculative stats (the vocabulary
    fields are null for ``ar``, which does not draft, and before a request's first round)."""
    mal, v = stats.mal, stats.vocab
    coverage, active = v.coverage, v.mean_active_size
    return {
        "method": method,
        "rounds": stats.rounds,
        "accepted": stats.accepted,
        "mal": None if mal is None else round(mal, 4),
        "draft_s": round(stats.draft_s, 6),
        "verify_s": round(stats.verify_s, 6),
        "coverage": None if coverage is None else round(coverage, 4),
        "active_vocab_size": None if active is None else round(active, 1),
        "oov_events": v.oov_events if v.rounds else None,
    }


def _logprobs_field(ctx: ServiceContext, job: _Job, lps: list[TokenLogprob], *, chat: bool) -> Any:
    """A choice's ``logprobs`` for tokens ``lps`` (None when the request did not ask): chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or the completions' columns
    (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: each token's start in the
    completion, counted in its text's characters across a stream's chunks)."""
    top = job.request.params.logprobs
    if top is None:
        return None
    codec = ctx.model.codec
    if chat:

        def entry(token: int, logprob: float) -> dict[str, Any]:
            raw = codec.token_bytes(token)
            return {
                "token": raw.decode("utf-8", errors="replace"),
                "logprob": _finite(logprob),
                "bytes": list(raw),
            }

        content = [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps
        ]
        return {"content": content, "refusal": None}
    texts = [codec.token_text(t.token) for t in lps]
    offsets = []
    for text in texts:
        offsets.append(job.offset)
        job.offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [_finite(t.logprob) for t in lps],
        "top_logprobs": [{codec.token_text(i): _finite(v) for i, v in t.top} for t in lps] if top else None,
        "text_offset": offsets,
    }


def _finite(logprob: float) -> float:
    """JSON has no infinities or NaN: a token without probability reports OpenAI's -9999."""
    return logprob if math.isfinite(logprob) else NO_PROBABILITY


def _usage(job: _Job) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V
    the engine reused from its last request instead of computing them (prefix reuse)."""
    p, c = len(job.request.prompt_ids), job.text.tokens_used
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": job.stats.cached_tokens},
    }


async def _respond(
    ctx: ServiceContext, job: _Job, body: SamplingFields, client: Request, *, chat: bool
) -> Any:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": ctx.model.name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(ctx, job, head, chat=chat, include_usage=include_usage)
        return _EngineStream(events, job)
    try:
        parts, lps, reason = [], [], "stop"
        async for piece in _pieces(ctx, job, client):
            parts.append(piece.text)
            lps += piece.logprobs
            reason = piece.finish or reason
    finally:
        if not job.ended:
            job.request.cancel(Outcome.DISCONNECTED)
    text = "".join(parts)
    logprobs = _logprobs_field(ctx, job, lps, chat=chat)
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        head["object"] = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return JSONResponse(
        {
            **head,
            "choices": [choice],
            "usage": _usage(job),
            "evospec": spec_fields(ctx.engine.method, job.stats),
        }
    )


def _sse_line(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(
    ctx: ServiceContext, job: _Job, head: dict[str, Any], *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(text: str | None, reason: str | None, lps: list[TokenLogprob], **extra: Any) -> str:
        logprobs = _logprobs_field(ctx, job, lps, chat=chat) if lps else None
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return _sse_line({**head, "choices": [choice], **extra})

    try:
        if chat:
            yield _sse_line(
                {
                    **head,
                    "choices": [
                        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                    ],
                }
            )
        async for piece in _pieces(ctx, job, None):
            if piece.text or piece.logprobs:
                yield chunk(piece.text, None, piece.logprobs)
            if piece.finish is not None:
                yield chunk(None, piece.finish, [], evospec=spec_fields(ctx.engine.method, job.stats))
        if include_usage:
            yield _sse_line({**head, "choices": [], "usage": _usage(job)})
    except APIError as exc:
        yield _sse_line(exc.body())
    yield "data: [DONE]\n\n"


class _EngineStream(StreamingResponse):
    """SSE response that cancels its engine request however the stream ends (e.g. disconnect)."""

    def __init__(self, content: AsyncIterator[str], job: _Job) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.ended:
                self.job.request.cancel(Outcome.DISCONNECTED)

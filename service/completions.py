"""Engine events -> OpenAI responses: one JSON body, or Server-Sent Events ending in ``data: [DONE]``.

Owns: :class:`Job` (one engine request as its handler sees it: its sink, text assembler, stats,
logprobs not yet sent), :func:`pieces` (a job's events -> text pieces, with stop strings,
disconnects and deadlines applied), and :func:`respond` -- the body or stream of a request's
``n`` choices, each one job (``openai_api.py`` submits them), with ``usage`` (the prompt counted
once), ``logprobs`` where asked and the ``evospec`` stats object. A streamed request's choices
are interleaved as their tokens come (each chunk names its ``index``). Whatever way a response
ends -- finished, disconnect, error -- its jobs still running are cancelled.
Knows nothing of prompts or the model beyond its codec.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from evospec.decoding.events import StepEvent
from evospec.decoding.logprobs import TokenLogprob
from evospec.decoding.stats import RequestStats
from service.context import ServiceContext
from service.errors import SERVER_ERROR, APIError
from service.requests import AsyncSink, Done, GenerationRequest, Outcome, PromptLogprobs
from service.schemas import SamplingFields
from service.textstream import TextAssembler
from service.tool_reader import EnvelopeReader
from service.tools import ToolPlan

_GRACE_S = 2.0  # the handler waits this much past the deadline for the engine's own timeout
_POLL_S = 0.5  # non-streaming handlers check for a client disconnect this often
Line = str | None  # an SSE line, or nothing to send
NO_PROBABILITY = -9999.0  # the logprob OpenAI reports for a token of no probability


@dataclass
class Job:
    """One submitted request (one choice) as its handler sees it."""

    request: GenerationRequest
    sink: AsyncSink
    text: TextAssembler
    stats: RequestStats = field(default_factory=RequestStats)
    ended: bool = False  # the handler saw the end (finish, stop string or error)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # tokens whose text was not sent yet
    offset: int = 0  # characters of token text reported so far (completions' ``text_offset``)
    echo: str | None = None  # the prompt's text, sent before the completion (completions' ``echo``)
    tools: ToolPlan | None = None  # what the answer may call (chat ``tools``): ``service/tools.py``
    call_id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    reader: EnvelopeReader | None = field(default=None, init=False)  # a streamed envelope, read as it comes

    def __post_init__(self) -> None:
        if self.tools is not None and not self.tools.named:
            self.reader = EnvelopeReader()

    @property
    def named_call(self) -> str | None:
        """The function a named call calls (its text is the arguments); None otherwise."""
        return self.tools.functions[0].name if self.tools is not None and self.tools.named else None


@dataclass(frozen=True)
class Piece:
    """Text that may be sent now, the logprobs of the tokens consumed since the last piece
    (empty unless the request asked), and the finish reason at the end."""

    text: str
    finish: str | None
    logprobs: list[TokenLogprob]
    prompt: list[TokenLogprob] | None = None  # the echoed prompt's logprobs (tokens 1..P-1)


def cancel_running(jobs: Sequence[Job]) -> None:
    """Cancel the jobs whose end the handler has not seen (a client gone, a sibling failed)."""
    for job in jobs:
        if not job.ended:
            job.request.cancel(Outcome.DISCONNECTED)


async def pieces(ctx: ServiceContext, job: Job, client: Request | None) -> AsyncIterator[Piece]:
    """Pieces until the end (the last has a finish reason); engine failures raise :class:`APIError`.

    ``client``: poll it for a disconnect while waiting (non-streaming requests).
    """
    req = job.request
    if job.echo is not None and req.prompt_logprobs is None:
        yield Piece(job.echo, None, [])  # echoed as it is; with logprobs, once they come
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
            yield _take(job, tail.text, "stop" if req.generate else "length")  # max_tokens 0
            return
        if isinstance(item, PromptLogprobs):
            yield Piece(job.echo or "", None, [], prompt=item.entries)
            continue
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


def _take(job: Job, text: str, finish: str | None) -> Piece:
    """A piece with the logprobs gathered since the last one."""
    piece = Piece(text, finish, job.logprobs)
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


# -- response fields --------------------------------------------------------------------------------
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


def _logprobs_field(
    ctx: ServiceContext,
    job: Job,
    lps: list[TokenLogprob],
    *,
    chat: bool,
    prompt: list[TokenLogprob] | None = None,
) -> Any:
    """A choice's ``logprobs`` for tokens ``lps`` (None when the request did not ask): chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or the completions' columns
    (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: each token's start in the
    returned text, counted in its text's characters across a stream's chunks), the echoed
    ``prompt``'s first (its first token has no logprob: null)."""
    top = job.request.params.logprobs
    if top is None:
        return None
    if prompt is not None and not chat:  # the echoed prompt comes first: its first token at 0
        head = ctx.model.codec.token_text(job.request.prompt_ids[0])
        start, job.offset = job.offset, job.offset + len(head)
        rest = _completion_columns(ctx, job, [*prompt, *lps], top)
        tops = rest["top_logprobs"]
        return {
            "tokens": [head, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": None if tops is None else [None, *tops],
            "text_offset": [start, *rest["text_offset"]],
        }
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
    return _completion_columns(ctx, job, lps, top)


def _completion_columns(ctx: ServiceContext, job: Job, lps: list[TokenLogprob], top: int) -> dict[str, Any]:
    """The completions' ``logprobs`` columns for ``lps``, their offsets counted on from the
    job's characters so far."""
    codec = ctx.model.codec
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


def _usage(jobs: Sequence[Job]) -> dict[str, Any]:
    """OpenAI's usage object: the prompt counted once, the completions of every choice;
    ``prompt_tokens_details.cached_tokens``: prompt tokens whose K/V the engine reused instead
    of computing them (prefix reuse), as the first choice found them."""
    p, c = len(jobs[0].request.prompt_ids), sum(job.text.tokens_used for job in jobs)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": jobs[0].stats.cached_tokens},
    }


def _folded(jobs: Sequence[Job]) -> RequestStats:
    total = RequestStats()
    for job in jobs:
        total.merge(job.stats)
    return total


# -- responses -------------------------------------------------------------------------------------
async def respond(
    ctx: ServiceContext, jobs: Sequence[Job], body: SamplingFields, client: Request, *, chat: bool
) -> Any:
    """The response to ``body``, whose choices are ``jobs`` (choice i: ``jobs[i]``)."""
    head = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": ctx.model.name,
    }
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _EngineStream(_sse(ctx, jobs, head, chat=chat, include_usage=include_usage), jobs)
    try:
        choices = await asyncio.gather(*(_choice(ctx, i, job, client, chat) for i, job in enumerate(jobs)))
    finally:
        cancel_running(jobs)
    if chat:
        head["object"] = "chat.completion"
    body = {**head, "choices": choices, "usage": _usage(jobs)}
    return JSONResponse({**body, "evospec": spec_fields(ctx.engine.method, _folded(jobs))})


async def _choice(ctx: ServiceContext, index: int, job: Job, client: Request, chat: bool) -> dict[str, Any]:
    """One whole choice of a JSON response."""
    parts, lps, reason, prompt = [], [], "stop", None
    async for piece in pieces(ctx, job, client):
        parts.append(piece.text)
        lps += piece.logprobs
        reason = piece.finish or reason
        prompt = piece.prompt if piece.prompt is not None else prompt
    text, logprobs = "".join(parts), _logprobs_field(ctx, job, lps, chat=chat, prompt=prompt)
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    name, arguments = job.named_call, text
    if job.reader is not None:  # the model chose: a call, or a reply in text
        job.reader.feed(text)
        name, arguments = job.reader.name, job.reader.arguments
        message["content"] = job.reader.content
    if name is not None:
        message = {"role": "assistant", "content": None, "tool_calls": [_call(job, name, arguments)]}
        reason = _call_reason(reason)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def _call(job: Job, name: str, arguments: str, *, index: int | None = None) -> dict[str, Any]:
    """A tool call of ``name`` with ``arguments`` (a stream's first delta: with ``index``)."""
    call = {"id": job.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def _chat_delta(job: Job, text: str) -> dict[str, Any]:
    """The ``delta`` of a streamed chat chunk carrying ``text``: content, a named call's
    arguments, or what a chosen call's envelope made known (its name, arguments, a reply)."""
    if job.named_call is not None:
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
    if job.reader is None:
        return {"content": text}
    known = job.reader.feed(text)
    if known.name is not None:
        return {"tool_calls": [_call(job, known.name, known.arguments, index=0)]}
    if known.arguments:
        return {"tool_calls": [{"index": 0, "function": {"arguments": known.arguments}}]}
    # a reply's first delta sets the content the stream's role chunk left null
    return {"content": known.content} if known.content or known.kind == "reply" else {}


def _finish_reason(job: Job, reason: str | None) -> str | None:
    """A chat choice's finish reason: a call's ``stop`` is ``tool_calls``."""
    called = job.named_call is not None or (job.reader is not None and job.reader.kind == "call")
    return _call_reason(reason) if called else reason


def _call_reason(reason: str | None) -> str | None:
    """OpenAI ends a finished tool call with ``"tool_calls"`` (``"length"`` stays: cut arguments)."""
    return "tool_calls" if reason == "stop" else reason


def _sse_line(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(
    ctx: ServiceContext, jobs: Sequence[Job], head: dict[str, Any], *, chat: bool, include_usage: bool
) -> AsyncIterator[str]:
    def chunk(i: int, text: str | None, reason: str | None, piece: Piece | None = None, **extra: Any) -> Line:
        """The SSE line of a piece or of a choice's end; None where a piece carries nothing to send
        (an envelope's bytes that made nothing known yet)."""
        lps, prompt = (piece.logprobs, piece.prompt) if piece is not None else ([], None)
        logprobs = _logprobs_field(ctx, jobs[i], lps, chat=chat, prompt=prompt) if lps or prompt else None
        if chat:
            delta = {} if text is None else _chat_delta(jobs[i], text)
            if not (delta or logprobs or reason):
                return None
            choice = {"index": i, "delta": delta, "logprobs": logprobs}
            choice["finish_reason"] = _finish_reason(jobs[i], reason)
        else:
            choice = {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return _sse_line({**head, "choices": [choice], **extra})

    try:
        if chat:
            for i, job in enumerate(jobs):
                opening = {"role": "assistant", "content": "" if job.reader is None else None}
                if job.named_call is not None:  # the call's id and name first, its arguments as they come
                    call = _call(job, job.named_call, "", index=0)
                    opening = {"role": "assistant", "content": None, "tool_calls": [call]}
                role = {"index": i, "delta": opening, "finish_reason": None}
                yield _sse_line({**head, "choices": [role]})
        async for i, piece in _interleaved(ctx, jobs):
            sent = piece.text or piece.logprobs or piece.prompt is not None
            line = chunk(i, piece.text, None, piece) if sent else None
            if line is not None:
                yield line
            if piece.finish is not None:
                yield chunk(i, None, piece.finish, evospec=spec_fields(ctx.engine.method, jobs[i].stats))
        if include_usage:
            yield _sse_line({**head, "choices": [], "usage": _usage(jobs)})
    except APIError as exc:
        yield _sse_line(exc.body())
    finally:
        cancel_running(jobs)
    yield "data: [DONE]\n\n"


async def _interleaved(ctx: ServiceContext, jobs: Sequence[Job]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) of every job as they come; the first failure raises here."""
    if len(jobs) == 1:
        async for piece in pieces(ctx, jobs[0], None):
            yield 0, piece
        return
    queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, job: Job) -> None:
        try:
            async for piece in pieces(ctx, job, None):
                await queue.put((i, piece))
            await queue.put((i, None))
        except Exception as exc:  # handed to the stream, which reports it
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


class _EngineStream(StreamingResponse):
    """SSE response that cancels its engine requests however the stream ends (e.g. disconnect)."""

    def __init__(self, content: AsyncIterator[str], jobs: Sequence[Job]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.jobs = jobs

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_running(self.jobs)

"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Owns: turning a validated request into :class:`~service.engine.GenerationRequest` s -- one per
choice (``n``) -- (prompt encoding through ``prompting.py``, off the event loop; the
context-window and ``max_tokens`` checks; sampling defaults as OpenAI's: temperature 1, top_p 1,
``max_tokens`` 16 for completions and "up to the context" for chat; choice i > 0 of a seeded
request draws from a seed of its own) and submitting them; ``completions.py`` shapes what comes
back. Every response carries ``usage`` (streams: with ``stream_options.include_usage``),
``logprobs`` where asked (the target's raw distribution at each token, ``decoding/logprobs.py``;
chat: ``logprobs`` + ``top_logprobs``, completions: ``logprobs`` = alternatives per token), and an
``evospec`` object with the request's speculative stats (method, rounds, accepted, MAL, draft
coverage, mean active vocabulary size, OOV events).

Handlers never touch the model: they validate, enqueue and await the engine's events. A client
that disconnects (mid-stream or while waiting) cancels its requests between rounds. The choices
of one request are separate engine requests, so the engine generates them together in its
batch (``--max-batch``) where it can.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from evospec.decoding.json_grammar import JsonGrammar
from evospec.decoding.sampling import SamplingParams, derived_seed
from service.completions import Job, cancel_running, respond
from service.context import ServiceContext
from service.engine import AsyncSink, EngineBusy, EngineStopped, GenerationRequest
from service.errors import SERVER_ERROR, APIError
from service.prompting import PromptEncoder
from service.schemas import ChatRequest, CompletionRequest, SamplingFields, parse_body
from service.textstream import TextAssembler
from service.tools import ToolPlan

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
REQUEST_BODIES: dict[str, type[BaseModel]] = {  # for the OpenAPI schema (app.py)
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatRequest,
}


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
        await asyncio.to_thread(body.check_supported)  # a schema's pattern may take ~0.5 s to compile
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
        echo = None  # the prompt's text, returned before the completion
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else ctx.model.codec.decode(ids)
        score_only = echo is not None and body.max_tokens == 0  # scoring the prompt (lm-eval's way)
        max_tokens = 1 if score_only else body.max_tokens
        default = COMPLETIONS_DEFAULT_MAX_TOKENS
        grammar = await _grammar(ctx, body)
        jobs = _submit(
            ctx,
            body,
            ids,
            max_tokens,
            "max_tokens",
            default,
            "prompt",
            grammar,
            echo=echo,
            generate=not score_only,
        )
        return await respond(ctx, jobs, body, request, chat=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await parse_body(request, ChatRequest)
        await asyncio.to_thread(body.check_supported)  # a schema's pattern may take ~0.5 s to compile
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
        grammar = await _grammar(ctx, body)
        max_tokens = body.requested_max_tokens
        jobs = _submit(ctx, body, ids, max_tokens, param, None, "messages", grammar, tools=body.tools_plan)
        return await respond(ctx, jobs, body, request, chat=True)

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
async def _grammar(ctx: ServiceContext, body: SamplingFields) -> JsonGrammar | None:
    """The JSON grammar ``response_format`` or a tool call asks for (None: text), fetched off
    the event loop: a request that comes before the token table is built (~0.9 s for 49k tokens,
    started with the server) waits for it while other streams keep flowing."""
    schema = body.output_schema
    if schema is None:
        return None
    return await asyncio.to_thread(ctx.model.json_grammar, *schema)


def _max_tokens(
    ctx: ServiceContext,
    ids: list[int],
    max_tokens: int | None,
    max_param: str,
    default_max: int | None,
    prompt_param: str,
) -> int:
    """The completion's token budget: the request's, checked against the context window and the
    server's limit, or the default that fits."""
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
    return max_tokens


def _submit(
    ctx: ServiceContext,
    body: SamplingFields,
    ids: list[int],
    max_tokens: int | None,
    max_param: str,
    default_max: int | None,
    prompt_param: str,
    grammar: JsonGrammar | None = None,
    *,
    echo: str | None = None,
    generate: bool = True,
    tools: ToolPlan | None = None,
) -> list[Job]:
    max_tokens = _max_tokens(ctx, ids, max_tokens, max_param, default_max, prompt_param)
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
            penalties=replace(body.penalties, grammar=grammar),
        )
    except ValueError as exc:
        raise APIError.bad_request(str(exc)) from None
    key = body.user if ctx.config.adapt.scope == "user" else None
    jobs: list[Job] = []
    try:
        for i in range(body.n or 1):
            choice = replace(params, seed=params.seed if i == 0 else derived_seed(params.seed, i))
            request = GenerationRequest(
                ids,
                choice,
                timeout_s=ctx.config.request_timeout,
                adapter_key=key,
                prompt_logprobs=params.logprobs if echo is not None else None,
                generate=generate,
            )
            sink = AsyncSink()
            ctx.engine.submit(request, sink)
            text = TextAssembler(ctx.model.codec, body.stops)
            jobs.append(Job(request, sink, text, echo=echo, tools=tools))
    except EngineBusy as exc:
        cancel_running(jobs)  # a request is all its choices or none
        raise APIError(
            503,
            f"server busy: {exc.depth} requests are queued (limit {ctx.engine.max_queue}); "
            f"retry after {exc.retry_after_s} s",
            type=SERVER_ERROR,
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after_s)},
        ) from None
    except EngineStopped:
        cancel_running(jobs)
        raise APIError(503, "the engine is not running", type=SERVER_ERROR, code="engine_stopped") from None
    return jobs

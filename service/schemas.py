"""Request bodies: strict pydantic schemas and the one parser every JSON route uses.

Owns: :func:`parse_body` (bytes -> UTF-8 -> JSON object -> schema, every failure an
:class:`~service.errors.APIError` 400 naming the offending ``param`` where there is one: an
integer literal past Python's digit limit and JSON nested past the parser's recursion limit
are refused as invalid JSON), the OpenAI request schemas (:class:`CompletionRequest`,
:class:`ChatRequest`) and their checks for fields this server does not support (``best_of``,
``tool_choice: "auto"``, ``echo`` with ``n > 1``, ...). Types are strict: ``"10"`` is not an
integer and ``true`` is not a number; text must be valid Unicode (a lone surrogate such as
``"\\ud800"`` is refused: the tokenizer cannot take it). Unknown fields are ignored, as
OpenAI-compatible servers (vLLM) do, with one warning per request naming them. Range checks
that need the server's limits (``max_tokens``, context window) live in ``openai_api.py``.
"""

from __future__ import annotations

import json
import logging
import sys
from functools import cached_property
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

from evospec.decoding.json_schema import OBJECT, Schema, SchemaError, compile_schema
from evospec.decoding.logprobs import MAX_TOP_LOGPROBS
from evospec.decoding.penalties import BIAS_RANGE, PENALTY_RANGE, REPETITION_RANGE, Penalties
from service.errors import APIError
from service.tools import ToolPlan, tool_plan, with_tools

log = logging.getLogger("evospec.service")

M = TypeVar("M", bound=BaseModel)
MAX_STOPS = 4
MAX_CHOICES = 16  # choices (``n``) one request may ask for: each is an engine request
MAX_LOGGED_FIELDS = 20  # an ignored-fields warning names at most this many
MAX_ID_DIGITS = 18  # the longest logit_bias key taken for a token id (every int64 fits)
INT64 = (-(2**63), 2**63 - 1)  # the seed range (torch generators take 64 bits)


async def parse_body(request: Request, schema: type[M], *, allow_empty: bool = False) -> M:
    """Read and validate a JSON object body against ``schema``."""
    raw = await request.body()
    if not raw.strip() and allow_empty:
        return schema.model_validate({})
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError.bad_request(
            f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_encoding"
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError.bad_request(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError:  # int(): a literal past sys.get_int_max_str_digits()
        raise APIError.bad_request(
            "request body is not valid JSON: an integer literal has more than "
            f"{sys.get_int_max_str_digits()} digits",
            code="invalid_json",
        ) from None
    if not isinstance(obj, dict):
        raise APIError.bad_request(
            f"request body must be a JSON object, got {_json_type(obj)}", code="invalid_json"
        )
    body = validate(schema, obj)
    ignored = ignored_fields(body, obj)
    if ignored:
        names = ", ".join(repr(n[:100]) for n in ignored[:MAX_LOGGED_FIELDS])
        more = f" and {len(ignored) - MAX_LOGGED_FIELDS} more" if len(ignored) > MAX_LOGGED_FIELDS else ""
        log.warning("%s %s: ignored unknown field(s) %s%s", request.method, request.url.path, names, more)
    return body


def validate(schema: type[M], obj: dict[str, Any]) -> M:
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    except RecursionError:
        raise _too_deep() from None


def ignored_fields(model: BaseModel, raw: Any, prefix: str = "") -> list[str]:
    """Keys of ``raw`` that ``model`` (validated from it) ignored, as dotted paths into nested
    models (``messages.0.mood``)."""
    if not isinstance(raw, dict):
        return []
    fields = type(model).model_fields
    out = [prefix + str(key) for key in raw if key not in fields]
    for name in fields:
        value, sub = getattr(model, name), raw.get(name)
        if isinstance(value, BaseModel):
            out += ignored_fields(value, sub, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel) and isinstance(sub, list):
            for i, (item, item_raw) in enumerate(zip(value, sub, strict=False)):
                out += ignored_fields(item, item_raw, f"{prefix}{name}.{i}.")
    return out


def _too_deep() -> APIError:
    return APIError.bad_request("request body is not valid JSON: nested too deeply", code="invalid_json")


def _unicode(text: str) -> str:
    """``text`` unchanged when it is valid Unicode (encodable as UTF-8, so no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone surrogate ({text[exc.start]!r} at index {exc.start}); text must be "
            "valid Unicode"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]

# What the "before" validators below accept, for the OpenAPI schema (app.py).
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        _TOKEN_IDS,
        {"type": "array", "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}, "minItems": 1, "maxItems": 1},
    ]
}
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]}


def _as_api_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "missing":
        return APIError.bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing")
    msg = str(err["msg"]).removeprefix("Value error, ")
    code = "invalid_type" if err["type"].endswith("_type") else "invalid_value"
    return APIError.bad_request(f"Invalid value for '{param}': {msg}.", param=param, code=code)


def _json_type(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (``null``, ``array``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _compiled(schema: dict[str, Any], param: str, where: str) -> tuple[str, Schema]:
    """(canonical text, compiled) of a request's JSON schema; 400 ``unsupported_schema`` naming
    ``where`` when the grammar cannot honour it."""
    try:
        return json.dumps(schema, sort_keys=True), compile_schema(schema)
    except SchemaError as exc:
        raise APIError(400, f"{where}: {exc}", param=param, code="unsupported_schema") from None


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: Text
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension (vLLM): -1 or 0 = off
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extension (vLLM)
    presence_penalty: float | None = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float | None = Field(default=None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> added to its logit
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1])
    # {"type": "text" | "json_object" | "json_schema"} (on completions: vLLM's extension)
    response_format: dict[str, Any] | None = None
    user: Text | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str):
            return _unicode(v)
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(v)}")
        return [_unicode(s) for s in v]

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (v or {}).items():
            # ids past the vocabulary: openai_api.py; a key too long for any id is refused here
            # (int() of more than 4,300 digits raises)
            if not (key.isascii() and key.isdigit()) or len(key) > MAX_ID_DIGITS:
                shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} characters)"
                raise ValueError(f"keys must be token ids, got {shown!r}")
            if not BIAS_RANGE[0] <= value <= BIAS_RANGE[1]:
                raise ValueError(f"values must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}], got {value}")
        return v

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives to report with each token's logprob; None: no logprobs."""
        return None

    @property
    def penalties(self) -> Penalties:
        """The presence / frequency / repetition penalties and logit_bias as decoding applies them."""
        bias = tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))
        repetition = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        return Penalties(self.presence_penalty or 0.0, self.frequency_penalty or 0.0, bias, repetition)

    @cached_property
    def tools_plan(self) -> ToolPlan | None:
        """What the answer may call (chat's ``tools`` / ``tool_choice``: ``service/tools.py``);
        None: the answer is text."""
        return None

    @cached_property
    def output_schema(self) -> tuple[str, Schema] | None:
        """The schema the output follows -- a called function's parameters; JSON mode: ("", any
        object); ``json_schema``: (its canonical text, compiled) -- or None for text; worked out
        once a request. 400 where the format is none of those, where a tool call and a format
        both ask, or where the schema goes past what the grammar supports (``json_schema.py``)."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        plan = self.tools_plan
        if plan is not None:
            if kind != "text":
                raise APIError.bad_request(
                    "a tool call and a response_format cannot both shape the answer", param="tool_choice"
                )
            if not plan.named:  # each tool's own schema first: an error names the tool, not the envelope
                for i, fn in enumerate(plan.functions):
                    _compiled(fn.schema(), "tools", f"tools[{i}] ({fn.name}): parameters")
            names = ", ".join(fn.name for fn in plan.functions)
            return _compiled(plan.schema(), "tools", f"tools: the parameters of {names}")
        if kind == "text":
            return None
        if kind == "json_object":
            return "", OBJECT
        if kind != "json_schema":
            raise APIError.bad_request(
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                param="response_format",
            )
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError.bad_request(
                "response_format json_schema needs a json_schema object with a schema",
                param="response_format",
            )
        return _compiled(spec["schema"], "response_format", "response_format")

    def check_supported(self) -> None:
        """Refuse what this server cannot honour instead of silently ignoring it."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise APIError.bad_request(f"n must be in 1..{MAX_CHOICES}, got {self.n}", param="n")
        _ = self.output_schema  # a 400 now, before anything is encoded


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = Field(...)  # see _prompt
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return _unicode(v)
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, str | list) for p in v):
            raise ValueError("several prompts in one request are not supported; send one per request")
        raise ValueError("must be a string or a non-empty list of token ids")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and (self.n or 1) > 1:
            raise APIError.unsupported("echo", "echo with several choices")
        if self.best_of not in (None, 1):
            raise APIError.unsupported("best_of", f"best_of={self.best_of}")
        if self.suffix:
            raise APIError.unsupported("suffix", "suffix")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a list of {"type": "text", "text": ...} parts is joined into one string
    content: Annotated[str | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    name: Text | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls (written into the prompt as JSON)
    tool_call_id: Text | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str):
            return _unicode(v)
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        texts = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise ValueError(
                    f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {kind!r}"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(
                    f"a text content part needs a 'text' string, got {_json_type(part.get('text'))}"
                )
            texts.append(part["text"])
        return _unicode("".join(texts))


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none", "auto", "required" or {"type": "function", ...}: service/tools.py
    parallel_tool_calls: bool | None = None  # accepted; an answer makes one call

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")

    @cached_property
    def tools_plan(self) -> ToolPlan | None:
        return tool_plan(self.tools, self.tool_choice)

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them (``developer`` is a system message; tool
        calls as text, the tools described: ``tools.with_tools``)."""
        messages = [
            {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content,
                "tool_calls": m.tool_calls,
            }
            for m in self.messages
        ]
        return with_tools(messages, self.tools_plan)

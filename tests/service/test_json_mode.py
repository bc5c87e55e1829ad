"""``response_format: {"type": "json_object"}`` through the OpenAI API: the text is one JSON
object (or its beginning, where ``max_tokens`` cut it), as plain decoding in JSON mode writes
it, under every method; other formats are clear 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import pydantic
import pytest

from evospec.decoding.json_grammar import DONE, JsonGrammar, TokenTable
from evospec.decoding.json_schema import compile_schema
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from tests.decoding.spec_helpers import ar_tokens
from tests.decoding.test_json_grammar import walk
from tests.service.helpers import MODEL_NAME, api_error, complete, perfect_draft_decoder, post_ok

JSON = {"type": "json_object"}
MESSAGES = [{"role": "user", "content": "Describe a cat as JSON."}]


@pytest.fixture(scope="module")
def grammar(codec, tiny) -> JsonGrammar:
    return JsonGrammar(TokenTable.for_codec(codec, codec.eos_ids, tiny.cfg.vocab_size))


def _want(tiny, codec, grammar, ids: list[int], n: int) -> str:
    params = SamplingParams(max_new_tokens=n, penalties=Penalties(grammar=grammar))
    return codec.decode(ar_tokens(tiny, ids, params, codec.eos_ids))


@pytest.mark.parametrize("method", ["ar", "perfect-draft"])
def test_chat_in_json_mode_writes_what_plain_decoding_in_json_mode_writes(
    serve, codec, tiny, grammar, method
):
    live = serve() if method == "ar" else serve(perfect_draft_decoder(tiny, codec))
    ids = codec.encode_chat(MESSAGES)
    body = post_ok(
        live, "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "response_format": JSON},
    )  # fmt: skip
    text = body["choices"][0]["message"]["content"]
    assert text == _want(tiny, codec, grammar, ids, 60)
    state = walk(text.encode())
    assert state is not None  # an object's beginning at least
    if body["choices"][0]["finish_reason"] == "stop":
        assert state.mode == DONE and isinstance(json.loads(text), dict)
    free = post_ok(live, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 60, "temperature": 0})
    assert walk(free["choices"][0]["message"]["content"].encode()) is None  # the mode bites


def test_completions_and_streams_take_json_mode_too(serve, codec, tiny, grammar):
    live = serve()
    prompt = "The answer, as JSON:"
    body = complete(live, prompt, 40, response_format=JSON)
    assert body["choices"][0]["text"] == _want(tiny, codec, grammar, codec.encode(prompt), 40)
    with live.http() as http:
        r = http.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                  "response_format": JSON, "stream": True},
        )  # fmt: skip
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    plain = complete(live, prompt, 8, response_format={"type": "text"})["choices"][0]["text"]
    assert plain == complete(live, prompt, 8)["choices"][0]["text"]


def test_a_json_schema_shapes_the_output_under_every_method(serve, codec, tiny):
    """The schema's keys in its order, its types and enums: the tiny random model writes them
    because nothing else is allowed; a speculative server writes the same text."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["name", "age", "kind", "tags"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    grammar = JsonGrammar(
        TokenTable.for_codec(codec, codec.eos_ids, tiny.cfg.vocab_size), compile_schema(schema)
    )
    want = codec.decode(
        ar_tokens(
            tiny,
            codec.encode_chat(MESSAGES),
            SamplingParams(max_new_tokens=80, penalties=Penalties(grammar=grammar)),
            codec.eos_ids,
        )
    )
    texts = []
    for live in (serve(), serve(perfect_draft_decoder(tiny, codec))):
        request = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "response_format": fmt}
        body = post_ok(live, "/v1/chat/completions", request)
        texts.append(body["choices"][0]["message"]["content"])
    assert texts == [want, want]
    state = grammar.machine.walk(grammar.start(), want.encode())
    assert state is not None and want.lstrip().startswith("{")
    assert '"name":' in want  # the first key is forced
    if state.mode == DONE:
        data = json.loads(want)
        assert list(data) == ["name", "age", "kind", "tags"] and data["kind"] in ("cat", "dog")


PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}  # lookaround


def test_a_pattern_shapes_its_string(serve, codec, tiny):
    """``pattern``: the string is one the expression is found in (json_regex.py); a speculative
    server writes the same text as plain decoding under the grammar."""
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": r"^[A-C]{2}-\d$"}, "n": {"type": "integer"}},
        "required": ["code", "n"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "coded", "schema": schema}}
    grammar = JsonGrammar(
        TokenTable.for_codec(codec, codec.eos_ids, tiny.cfg.vocab_size), compile_schema(schema)
    )
    params = SamplingParams(max_new_tokens=60, penalties=Penalties(grammar=grammar))
    want = codec.decode(ar_tokens(tiny, codec.encode_chat(MESSAGES), params, codec.eos_ids))
    for live in (serve(), serve(perfect_draft_decoder(tiny, codec))):
        request = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "response_format": fmt}
        assert post_ok(live, "/v1/chat/completions", request)["choices"][0]["message"]["content"] == want
    code = want.split('"code"', 1)[1].split('"')[1]  # the forced key, then the string's text
    assert re.fullmatch(r"[A-C]{2}-\d", code), want


@pytest.mark.parametrize(
    ("fmt", "status", "code"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}},
            400,
            "unsupported_schema",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": PATTERN}}, 400, "unsupported_schema"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, 400, "invalid_value"),
        ({"type": "json_schema", "json_schema": "x"}, 400, "invalid_value"),
        ({"type": "xml"}, 400, "invalid_value"),
        ({}, 200, None),  # no type: text
    ],
)
def test_other_response_formats_are_clear_errors(serve, fmt, status, code):
    live = serve()
    with live.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "response_format": fmt},
        )
    if code is None:
        assert r.status_code == 200, r.text
    else:
        assert api_error(r, status, code)["param"] == "response_format"


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)
    indoor: bool


def test_the_openai_sdk_parses_pydantic_models_from_the_answer_and_from_a_tool_call(serve):
    """The SDK's strict schemas (``chat.completions.parse``) and function tools
    (``openai.pydantic_function_tool``), as a client sends them; a schema without free text, so
    that even the tiny random model closes it."""
    import openai

    client = serve().openai()
    messages = [{"role": "user", "content": "Describe a pet."}]
    out = client.chat.completions.parse(
        model=MODEL_NAME, messages=messages, response_format=Pet, max_tokens=128, temperature=0
    )
    assert isinstance(out.choices[0].message.parsed, Pet)
    out = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=messages,
        tools=[openai.pydantic_function_tool(Pet)],
        tool_choice="required",
        max_tokens=100,  # the tiny model's window: 256, the function's description ~150 of them
        temperature=0,
    )
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "Pet" and isinstance(call.function.parsed_arguments, Pet)
    assert out.choices[0].finish_reason == "tool_calls"

"""Function calling. A named ``tool_choice``: the answer is one tool call whose arguments are
what plain decoding writes under the function's parameters schema. ``auto`` and ``required``
with several tools: the model writes one JSON envelope under a schema of every call (and, for
``auto``, a reply), which comes back as a call or as text. Both stream as OpenAI streams calls;
what is not supported is a clear 400."""

from __future__ import annotations

import json
from typing import Literal

import pydantic
import pytest

from evospec.decoding.json_grammar import DONE, JsonGrammar, JsonMachine, TokenTable
from evospec.decoding.json_schema import compile_schema
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from service.schemas import ChatRequest
from service.tool_reader import EnvelopeReader
from tests.decoding.spec_helpers import ar_tokens
from tests.service.helpers import MODEL_NAME, api_error, perfect_draft_decoder, post_ok

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
DATED = {  # a parameter the grammar cannot check
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"d": {"type": "string", "format": "ipv6"}}},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _located(name: str, kinds: list[str]) -> dict:
    """A tool whose parameters refer to a definition named Loc, as Pydantic writes nested models."""
    loc = {"type": "object", "properties": {"kind": {"enum": kinds}}, "required": ["kind"]}
    return _tool(
        name,
        {
            "type": "object",
            "properties": {"loc": {"$ref": "#/$defs/Loc"}},
            "required": ["loc"],
            "$defs": {"Loc": loc},
        },
    )


def _body(**extra) -> dict:
    return {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, **extra}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip


def _want(codec, tiny, body: dict) -> str:
    """What plain decoding writes for ``body`` under the schema its tools ask for."""
    request = ChatRequest.model_validate(body)
    table = TokenTable.for_codec(codec, codec.eos_ids, tiny.cfg.vocab_size)
    grammar = JsonGrammar(table, request.output_schema[1])
    ids = codec.encode_chat(request.template_messages())
    params = SamplingParams(max_new_tokens=body["max_tokens"], penalties=Penalties(grammar=grammar))
    return codec.decode(ar_tokens(tiny, ids, params, codec.eos_ids))


def test_the_function_is_described_to_the_model_and_earlier_calls_are_written_as_text():
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    messages = ChatRequest.model_validate(
        _body(messages=history, tools=[WEATHER], tool_choice=NAMED)
    ).template_messages()
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(
        "Be brief.\n\nCall the function `get_weather`"
    )
    assert '"required": ["city", "unit"]' in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert messages[3] == {"role": "tool", "content": "18 C"}
    plain = ChatRequest.model_validate(_body(tools=[WEATHER], tool_choice="none")).template_messages()
    assert plain == [{"role": "user", "content": MESSAGES[0]["content"]}]  # no call: no instruction


@pytest.mark.parametrize("choice", [NAMED, "required"])
@pytest.mark.parametrize("method", ["ar", "perfect-draft"])
def test_a_named_call_answers_with_arguments_plain_decoding_writes_under_the_schema(
    serve, codec, tiny, choice, method
):
    live = serve() if method == "ar" else serve(perfect_draft_decoder(tiny, codec))
    body = _body(tools=[WEATHER], tool_choice=choice)
    out = post_ok(live, "/v1/chat/completions", body)["choices"][0]
    message = out["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == _want(codec, tiny, body)
    machine = JsonMachine(compile_schema(WEATHER["function"]["parameters"]))
    state = machine.walk(machine.start(), call["function"]["arguments"].encode())
    assert state is not None
    assert out["finish_reason"] == ("tool_calls" if state.mode == DONE else "length")


def test_a_call_that_closes_its_arguments_finishes_with_tool_calls(serve):
    """An enum-only schema leaves the random model nothing to ramble in: the call completes."""
    unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}}}  # fmt: skip
    out = post_ok(serve(), "/v1/chat/completions", _body(tools=[unit], tool_choice="required", max_tokens=80))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["unit"] in ("C", "F")


def test_a_streamed_call_sends_its_name_first_and_then_its_arguments(serve, codec, tiny):
    live = serve()
    whole = post_ok(live, "/v1/chat/completions", _body(tools=[WEATHER], tool_choice=NAMED))
    with live.http() as http:
        r = http.post("/v1/chat/completions", json=_body(tools=[WEATHER], tool_choice=NAMED, stream=True))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]["delta"]
    assert first["content"] is None
    opening = first["tool_calls"][0]
    assert opening["index"] == 0 and opening["function"] == {"name": "get_weather", "arguments": ""}
    arguments = "".join(
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for c in chunks[1:]
        if c["choices"][0]["delta"].get("tool_calls")
    )
    assert arguments == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("extra", "code", "param"),
    [
        ({"tools": [WEATHER, WEATHER], "tool_choice": "auto"}, "invalid_value", "tools.1"),  # a name twice
        ({"tools": [WEATHER, DATED]}, "unsupported_schema", "tools"),  # auto: every tool's parameters
        ({"tools": [WEATHER, DATED], "tool_choice": "required"}, "unsupported_schema", "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "invalid_value", "tool_choice"),
        ({"tool_choice": NAMED}, "invalid_value", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": [1]}}},
         "invalid_value", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}},
         "invalid_value", "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": 3}, "invalid_value", "tool_choice"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "invalid_value", "tools.0"),
        ({"tools": [_tool("s", {"type": "string"})]}, "invalid_value", "tools.0"),  # not an object
        ({"tools": [WEATHER, _tool("get weather!", {})]}, "invalid_value", "tools.1"),  # OpenAI refuses it
        ({"tools": [WEATHER, _tool("x" * 65, {})]}, "invalid_value", "tools.1"),
        ({"tools": [DATED], "tool_choice": "required"}, "unsupported_schema", "tools"),
        ({"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "invalid_value", "tool_choice"),
    ],
)  # fmt: skip
def test_what_function_calling_cannot_honour_is_a_clear_400(serve, extra, code, param):
    live = serve()
    with live.http() as http:
        r = http.post("/v1/chat/completions", json=_body(**extra))
    assert api_error(r, 400, code)["param"] == param


def test_an_unsupported_parameter_under_auto_names_its_tool(serve):
    live = serve()
    with live.http() as http:
        r = http.post("/v1/chat/completions", json=_body(tools=[WEATHER, DATED]))
    assert api_error(r, 400, "unsupported_schema")["message"].startswith("tools[1] (f): parameters")


def test_definitions_of_several_tools_keep_their_own_names_under_auto(serve, codec):
    """Each tool's $defs move to the envelope's root under names of their own: two tools that both
    define Loc keep theirs apart, and a call's arguments follow its own tool's definition."""
    tools = [_located("here", ["city"]), _located("there", ["country"])]
    plan = ChatRequest.model_validate(_body(tools=tools)).tools_plan
    schema = plan.schema()
    assert set(schema["$defs"]) == {"tool0.$defs.Loc", "tool1.$defs.Loc"}
    refs = [c["properties"]["arguments"]["properties"]["loc"]["$ref"] for c in schema["anyOf"][:2]]
    assert refs == ["#/$defs/tool0.$defs.Loc", "#/$defs/tool1.$defs.Loc"]
    assert tools[0]["function"]["parameters"]["$defs"]  # the request's own schema is not changed
    machine = JsonMachine(ChatRequest.model_validate(_body(tools=tools)).output_schema[1])

    def walks(text: str):
        state = machine.walk(machine.start(), text.encode())
        return state is not None and state.mode == DONE

    assert walks('{"name": "here", "arguments": {"loc": {"kind": "city"}}}')
    assert walks('{"name": "there", "arguments": {"loc": {"kind": "country"}}}')
    assert not walks('{"name": "here", "arguments": {"loc": {"kind": "country"}}}')
    live = serve()
    for tool_choice in ("auto", "required"):  # served, no longer a 400 for a $ref
        post_ok(live, "/v1/chat/completions", _body(tools=tools, tool_choice=tool_choice))


def test_a_request_works_its_tool_call_and_schema_out_once(monkeypatch):
    import service.schemas

    compiled = []
    real = service.schemas.compile_schema
    monkeypatch.setattr(service.schemas, "compile_schema", lambda s: compiled.append(s) or real(s))
    request = ChatRequest.model_validate(_body(tools=[WEATHER], tool_choice=NAMED))
    request.check_supported()
    request.template_messages()
    assert request.output_schema[0] == json.dumps(WEATHER["function"]["parameters"], sort_keys=True)
    assert request.tools_plan is request.tools_plan and len(compiled) == 1


def test_odd_earlier_calls_are_written_as_they_are():
    calls = [{"function": "x"}, 7, {"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]
    history = [*MESSAGES, {"role": "assistant", "tool_calls": calls}]
    messages = ChatRequest.model_validate(_body(messages=history)).template_messages()
    assert [json.loads(line) for line in messages[1]["content"].splitlines()] == [
        {"name": None, "arguments": None},
        {"name": None, "arguments": None},
        {"name": "f", "arguments": {"a": 1}},
    ]


@pytest.mark.parametrize("depth", [10, 5000])
def test_earlier_arguments_nested_past_what_json_reads_are_written_as_their_string(depth: int):
    nested = "[" * depth + "]" * depth  # valid JSON; past ~1,000 levels Python's reader recurses out
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": nested}}]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}]
    written = json.loads(
        ChatRequest.model_validate(_body(messages=history)).template_messages()[1]["content"]
    )
    assert written["name"] == "f"
    assert written["arguments"] == (nested if depth > 1000 else json.loads(nested))


def test_tool_choice_none_answers_with_text(serve):
    live = serve()
    out = post_ok(live, "/v1/chat/completions", _body(tools=[WEATHER], tool_choice="none"))["choices"][0]
    assert isinstance(out["message"]["content"], str) and "tool_calls" not in out["message"]


def _message_of_stream(text: str) -> tuple[dict, str]:
    """A streamed chat answer put together as a whole one's message (the call's id aside), and
    its finish reason."""
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    content, name, arguments = "", None, ""
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            assert call["index"] == 0
            if "id" in call:
                assert name is None and call["type"] == "function"
                name = call["function"]["name"]
            arguments += call["function"]["arguments"]
    reason = chunks[-1]["choices"][0]["finish_reason"]
    if name is None:
        return {"role": "assistant", "content": content}, reason
    assert content == ""
    return {"role": "assistant", "content": None, "name": name, "arguments": arguments}, reason


def _message(whole: dict) -> dict:
    message = dict(whole["message"])
    calls = message.pop("tool_calls", None)
    if calls:
        (call,) = calls
        assert call["type"] == "function" and call["id"].startswith("call_")
        message |= {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
    return message


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("method", ["ar", "perfect-draft"])
def test_a_chosen_call_is_the_envelope_plain_decoding_writes_read_back(serve, codec, tiny, choice, method):
    """auto / required with several tools: the model writes {"name", "arguments"} (or, auto,
    {"response"}) under one schema; the answer is that envelope read as a call or a reply."""
    live = serve() if method == "ar" else serve(perfect_draft_decoder(tiny, codec))
    body = _body(tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60)
    out = post_ok(live, "/v1/chat/completions", body)["choices"][0]
    envelope = _want(codec, tiny, body)
    reader = EnvelopeReader()
    reader.feed(envelope)
    machine = JsonMachine(ChatRequest.model_validate(body).output_schema[1])
    closed = machine.walk(machine.start(), envelope.encode())
    assert closed is not None  # the envelope follows the schema, whole or cut
    if choice == "required":
        assert reader.kind == "call"
    message = _message(out)
    if reader.kind == "call":
        assert message == {
            "role": "assistant",
            "content": None,
            "name": reader.name,
            "arguments": reader.arguments,
        }
        assert out["finish_reason"] == ("tool_calls" if closed.mode == DONE else "length")
        if closed.mode == DONE:
            assert json.loads(envelope) == {"name": reader.name, "arguments": json.loads(reader.arguments)}
    else:
        assert message == {"role": "assistant", "content": reader.content}
        assert out["finish_reason"] == ("stop" if closed.mode == DONE else "length")


def test_auto_calls_or_replies_and_a_stream_tells_the_same_answer(serve):
    """Sampled answers (seeded: a stream and a whole answer draw the same tokens) under auto:
    both kinds of answer come up, and each stream puts together into the whole answer."""
    live = serve()
    kinds = set()
    for seed in range(24):
        body = _body(tools=[WEATHER, TIME], temperature=1.0, seed=seed, max_tokens=48)
        whole = post_ok(live, "/v1/chat/completions", body)["choices"][0]
        with live.http() as http:
            streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        message, reason = _message_of_stream(streamed.text)
        assert message == _message(whole) and reason == whole["finish_reason"]
        kinds.add("call" if message["content"] is None else "reply")
        if kinds == {"call", "reply"} and seed >= 3:
            break
    assert kinds == {"call", "reply"}


def test_earlier_calls_are_written_as_the_envelope_the_model_writes():
    history = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "12:00"},
    ]  # fmt: skip
    request = ChatRequest.model_validate(_body(messages=history, tools=[WEATHER, TIME]))
    messages = request.template_messages()
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith(
        "You can call these functions:"
    )
    assert '{"response": TEXT}' in messages[0]["content"]
    envelope = JsonMachine(request.output_schema[1])
    assert envelope.walk(envelope.start(), messages[2]["content"].encode()).mode == DONE
    required = ChatRequest.model_validate(_body(tools=[WEATHER, TIME], tool_choice="required"))
    assert "response" not in required.template_messages()[0]["content"]


def test_the_openai_sdk_streams_and_parses_a_chosen_answer(serve):
    """Several tools and ``required`` (the model choosing, as under ``auto``), as an agent sends
    them through the SDK: the call is parsed into its model, and the SDK's stream helper puts the
    chunks together into what the whole answer says. (Enum arguments: even the tiny random
    model closes them, where a reply would run to the length limit, which ``parse`` refuses.)"""
    import openai

    class Zone(pydantic.BaseModel):
        zone: Literal["UTC", "CET"]

    class Unit(pydantic.BaseModel):
        unit: Literal["C", "F"]

    client = serve().openai()
    ask = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 60, "temperature": 0}
    tools = [openai.pydantic_function_tool(Zone), openai.pydantic_function_tool(Unit)]
    whole = client.chat.completions.parse(**ask, tools=tools, tool_choice="required").choices[0]
    with client.chat.completions.stream(**ask, tools=tools, tool_choice="required") as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason
    assert final.message.content == whole.message.content
    calls = [
        (c.function.name, c.function.arguments, c.function.parsed_arguments)
        for c in whole.message.tool_calls or []
    ]
    assert calls == [
        (c.function.name, c.function.arguments, c.function.parsed_arguments)
        for c in final.message.tool_calls or []
    ]
    assert whole.finish_reason == "tool_calls" and len(calls) == 1
    assert isinstance(calls[0][2], Zone | Unit) and calls[0][0] == type(calls[0][2]).__name__

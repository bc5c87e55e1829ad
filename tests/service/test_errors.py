"""Client mistakes get an OpenAI-style error body with the right 4xx, never a 500.

Driven with raw httpx so malformed bytes reach the server unchanged."""

from __future__ import annotations

import json

import pytest

from tests.service.helpers import CONTEXT, MAX_TOKENS_LIMIT, MODEL_NAME, LiveServer

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
MSGS = [{"role": "user", "content": "Hi"}]
LONG = "word " * (CONTEXT + 10)


def _with(**kw) -> dict:
    return {**OK, **kw}


def _chat(*messages: dict) -> dict:
    return {"model": MODEL_NAME, "messages": list(messages)}


def _without(key: str) -> dict:
    return {k: v for k, v in OK.items() if k != key}


# (path, body: dict or raw bytes, status, param, code)
CASES = [
    ("invalid_json", C, b'{"model": "tiny-llama", "prompt": ', 400, None, "invalid_json"),
    ("invalid_utf8", C, b'{"model": "tiny-llama", "prompt": "\xff\xfe"}', 400, None, "invalid_encoding"),
    ("not_an_object", C, b"[1, 2, 3]", 400, None, "invalid_json"),
    ("empty_body", C, b"", 400, None, "invalid_json"),
    ("missing_model", C, _without("model"), 400, "model", "missing"),
    ("missing_prompt", C, _without("prompt"), 400, "prompt", "missing"),
    ("missing_messages", CHAT, {"model": MODEL_NAME}, 400, "messages", "missing"),
    ("empty_messages", CHAT, {"model": MODEL_NAME, "messages": []}, 400, "messages", "invalid_value"),
    ("max_tokens_string", C, _with(max_tokens="10"), 400, "max_tokens", "invalid_type"),
    ("max_tokens_float", C, _with(max_tokens=4.5), 400, "max_tokens", "invalid_type"),
    ("max_tokens_zero", C, _with(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max_tokens_negative", C, _with(max_tokens=-3), 400, "max_tokens", "invalid_value"),
    ("max_tokens_over_limit", C, _with(max_tokens=MAX_TOKENS_LIMIT + 1), 400, "max_tokens", "invalid_value"),
    (
        "max_completion_tokens_zero",
        CHAT,
        {"model": MODEL_NAME, "messages": MSGS, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "invalid_value",
    ),
    ("temperature_string", C, _with(temperature="hot"), 400, "temperature", "invalid_type"),
    ("temperature_bool", C, _with(temperature=True), 400, "temperature", "invalid_type"),
    ("temperature_range", C, _with(temperature=3.5), 400, "temperature", "invalid_value"),
    (
        "temperature_nan",
        C,
        b'{"model": "tiny-llama", "prompt": "a", "temperature": NaN}',
        400,
        "temperature",
        None,
    ),
    ("top_p_zero", C, _with(top_p=0), 400, "top_p", "invalid_value"),
    ("seed_string", C, _with(seed="x"), 400, "seed", "invalid_type"),
    ("stream_string", C, _with(stream="yes"), 400, "stream", "invalid_type"),
    ("stop_type", C, _with(stop=3), 400, "stop", "invalid_value"),
    ("too_many_stops", C, _with(stop=["a", "b", "c", "d", "e"]), 400, "stop", "invalid_value"),
    ("prompt_type", C, _with(prompt=42), 400, "prompt", "invalid_value"),
    ("several_prompts", C, _with(prompt=["a", "b"]), 400, "prompt", "invalid_value"),
    ("empty_prompt", C, _with(prompt=""), 400, "prompt", "invalid_value"),
    ("token_out_of_vocab", C, _with(prompt=[1, 10**6]), 400, "prompt", "invalid_value"),
    ("prompt_too_long", C, _with(prompt=LONG), 400, "prompt", "context_length_exceeded"),
    (
        "prompt_plus_max_tokens_too_long",
        C,
        _with(prompt="word " * (CONTEXT - 60), max_tokens=MAX_TOKENS_LIMIT),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "chat_too_long",
        CHAT,
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": LONG}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    ("unknown_model", C, _with(model="gpt-17"), 404, "model", "model_not_found"),
    ("n_too_many", C, _with(n=17), 400, "n", "invalid_value"),
    ("n_zero", C, _with(n=0), 400, "n", "invalid_value"),
    ("best_of", C, _with(best_of=3), 400, "best_of", "unsupported_parameter"),
    ("echo_choices", C, _with(echo=True, n=2), 400, "echo", "unsupported_parameter"),
    ("bad_role", CHAT, _chat({"role": "wizard", "content": "x"}), 400, "messages.0.role", "invalid_value"),
    ("content_type", CHAT, _chat({"role": "user", "content": 5}), 400, "messages.0.content", "invalid_value"),
    (
        "image_part",
        CHAT,
        _chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        400,
        "messages.0.content",
        "invalid_value",
    ),
    (
        "tools",
        CHAT,
        {"model": MODEL_NAME, "messages": MSGS, "tools": [{"type": "function"}]},
        400,
        "tools.0",  # a tool without a function (service/tools.py)
        "invalid_value",
    ),
    ("messages_not_list", CHAT, {"model": MODEL_NAME, "messages": "hi"}, 400, "messages", "invalid_type"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input(ar_server: LiveServer, path: str, body, status: int, param, code) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with ar_server.http() as http:
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        (C, b"null", "must be a JSON object, got null"),
        (C, b'"text"', "must be a JSON object, got string"),
        (CHAT, _chat({"role": "user", "content": [{"type": "text"}]}), "needs a 'text' string, got null"),
        (
            CHAT,
            _chat({"role": "user", "content": [{"type": "text", "text": 3}]}),
            "'text' string, got number",
        ),
    ],
)
def test_messages_name_what_is_wrong_in_json_terms(ar_server: LiveServer, path: str, body, says: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with ar_server.http() as http:
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_unknown_route_and_method(ar_server: LiveServer) -> None:
    with ar_server.http() as http:
        r404 = http.get("/v1/nothing-here")
        r405 = http.get(C)
    assert r404.status_code == 404 and r404.json()["error"]["code"] == "not_found"
    assert r405.status_code == 405 and r405.json()["error"]["code"] == "method_not_allowed"


def test_errors_do_not_reach_the_engine(ar_server: LiveServer) -> None:
    before = ar_server.engine.snapshot().submitted
    with ar_server.http() as http:
        http.post(C, json=_with(max_tokens=0))
    assert ar_server.engine.snapshot().submitted == before

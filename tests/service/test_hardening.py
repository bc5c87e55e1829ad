"""Hostile or broken HTTP input (issue 21): every case gets the OpenAI error shape and its 4xx,
never a 500, and nothing holds a connection or the event loop.

Covers integer literals too long for ``int``, JSON nested past the parser's recursion limit,
lone surrogates, tiny temperatures, seeds outside int64, unknown fields (ignored, one warning),
the body size limit (Content-Length and chunked), the body read timeout, the prompt length
bound checked before tokenising, tokenisation off the event loop, and internal errors (500
with ``Connection: close``, logged once). Malformed bytes go through raw sockets or raw httpx.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from service.errors import INVALID_REQUEST, APIError
from tests.service.helpers import MODEL_NAME, LiveServer

C, CHAT = "/v1/completions", "/v1/chat/completions"
HEADERS = {"Content-Type": "application/json"}


def _post(live: LiveServer, path: str, content: bytes, **kw: Any) -> httpx.Response:
    with live.http() as http:
        return http.post(path, content=content, headers=HEADERS, **kw)


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """The error object of a response that must have failed with ``status`` (OpenAI shape)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status < 500:
        assert err["type"] == INVALID_REQUEST
    if param is not None:
        assert err["param"] == param
    return err


def _raw(live: LiveServer, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh socket and read until the server closes it (or ``timeout``)."""
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def _raw_status(reply: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    if headers.get("transfer-encoding") == "chunked":  # one chunk is all these small bodies need
        body = body.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return int(lines[0].split()[1]), headers, json.loads(body)


# -- parsing: integers, nesting, surrogates, seeds --------------------------------------------------
def test_integer_literal_with_thousands_of_digits(ar_server: LiveServer) -> None:
    body = b'{"model": "tiny-llama", "prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}"
    err = _error(_post(ar_server, C, body), 400)
    assert err["code"] == "invalid_json" and "4300 digits" in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "tiny-llama", "prompt": "a", "tools": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "tiny-llama", "prompt": "a", "x": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_001,
    ],
    ids=["top_level", "in_a_field", "objects"],
)
def test_json_nested_100000_deep(ar_server: LiveServer, body: bytes) -> None:
    err = _error(_post(ar_server, C, body), 400)
    assert err["code"] == "invalid_json" and "nested" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (C, b'{"model": "tiny-llama", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (C, b'{"model": "tiny-llama", "prompt": ["\\udfff"], "max_tokens": 2}', "prompt"),
        (
            CHAT,
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages.0.content",
        ),
        (
            CHAT,
            b'{"model": "tiny-llama", "messages": [{"role": "user", "content": '
            b'[{"type": "text", "text": "\\udc00"}]}]}',
            "messages.0.content",
        ),
        (C, b'{"model": "tiny-\\ud800", "prompt": "a"}', "model"),
        (C, b'{"model": "tiny-llama", "prompt": "a", "stop": ["\\ud800"]}', "stop"),
        (C, b'{"model": "tiny-llama", "prompt": "a", "user": "\\ud800"}', "user"),
    ],
    ids=["prompt", "prompt_list", "chat_content", "chat_part", "model", "stop", "user"],
)
def test_lone_surrogate_names_the_param(ar_server: LiveServer, path: str, body: bytes, param: str) -> None:
    err = _error(_post(ar_server, path, body), 400, param)
    assert "surrogate" in err["message"]


def test_error_bodies_escape_lone_surrogates() -> None:
    # messages and params may quote the request; a lone surrogate must not make the body unencodable
    response = APIError.bad_request(
        "The model 'a\ud800' does not exist", param="logit_bias.\udfff"
    ).response()
    err = json.loads(response.body)["error"]
    assert err["message"] == "The model 'a\\ud800' does not exist" and err["param"] == "logit_bias.\\udfff"


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64, 10**30])
def test_seed_outside_int64_is_refused(ar_server: LiveServer, seed: int) -> None:
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2, "temperature": 1, "seed": seed}
    _error(_post(ar_server, C, json.dumps(body).encode()), 400, "seed")


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seed_inside_int64_is_served(ar_server: LiveServer, seed: int) -> None:
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2, "temperature": 1, "seed": seed}
    r = _post(ar_server, C, json.dumps(body).encode())
    assert r.status_code == 200, r.text


# -- sampling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 9e-6])
def test_temperature_below_epsilon_is_greedy(ar_server: LiveServer, codec, reference, temperature) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": temperature}
    r = _post(ar_server, C, json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference(codec.encode("Once upon a time"), 8)


def test_top_p_below_float32_range_keeps_the_top_token(ar_server: LiveServer, codec, reference) -> None:
    # found by test_fuzz.py: 5e-324 is 0.0 in float32, and the nucleus mask dropped every token (500)
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 1,
        "top_p": 5e-324,
    }
    r = _post(ar_server, C, json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference(codec.encode("Once upon a time"), 8)


# -- unknown fields --------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_one_warning(
    ar_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi", "mood": "happy"}],
        "max_tokens": 2,
        "temperature": 0,
        "frobnicate": True,
        "stream_options": None,
        "reasoning_effort": "high",
    }
    with caplog.at_level(logging.WARNING, logger="evospec.service"):
        r = _post(ar_server, CHAT, json.dumps(body).encode())
    assert r.status_code == 200, r.text
    warnings = [rec for rec in caplog.records if rec.name == "evospec.service" and "ignored" in rec.message]
    assert len(warnings) == 1, [rec.message for rec in warnings]
    msg = warnings[0].message
    assert "'frobnicate'" in msg and "'reasoning_effort'" in msg and "'messages.0.mood'" in msg
    assert "'model'" not in msg and CHAT in msg


def test_known_fields_only_log_nothing(ar_server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 2, "temperature": 0}
    with caplog.at_level(logging.WARNING, logger="evospec.service"):
        assert _post(ar_server, C, json.dumps(body).encode()).status_code == 200
    assert not [rec for rec in caplog.records if rec.name == "evospec.service"]


# -- internal errors -------------------------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def error_logs() -> Iterator[_Records]:
    """ERROR records of our logger and of uvicorn's (which does not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger("evospec.service"), logging.getLogger("uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def test_internal_error_is_500_with_connection_close_and_logged_once(
    serve, monkeypatch: pytest.MonkeyPatch, error_logs: _Records
) -> None:
    live = serve()

    def broken(*args: Any, **kw: Any) -> None:
        raise RuntimeError("injected handler failure")

    monkeypatch.setattr(live.engine, "submit", broken)
    body = json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 2}).encode()
    with live.http() as http:  # one keep-alive client for both requests
        r = http.post(C, content=body, headers=HEADERS)
        err = _error(r, 500)
        assert err == {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
        assert r.headers["connection"] == "close"
        assert "injected" not in r.text
        assert http.get("/health").status_code == 200  # the client reconnects cleanly
    time.sleep(0.2)  # let a late uvicorn log line land, if any
    errors = [rec for rec in error_logs.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1, [rec.getMessage() for rec in errors]
    assert errors[0].name == "evospec.service" and errors[0].exc_info is not None


def test_generation_failure_500_closes_the_connection(serve, tiny, codec) -> None:
    from evospec.decoding.methods import make_decoder
    from tests.service.helpers import FailingDecoder

    trigger = codec.encode("Boom")[0]
    live = serve(FailingDecoder(make_decoder("ar", tiny, eos_ids=codec.eos_ids), trigger=trigger))
    body = json.dumps({"model": MODEL_NAME, "prompt": "Boom", "max_tokens": 2}).encode()
    r = _post(live, C, body)
    assert _error(r, 500)["code"] == "generation_failed"
    assert r.headers["connection"] == "close"


# -- body size, read timeout -----------------------------------------------------------------------
def test_content_length_over_the_limit_is_413_before_the_body_is_sent(serve) -> None:
    live = serve(max_body_bytes=1000)
    head = (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50000000\r\n\r\n"
    )
    status, headers, body = _raw_status(_raw(live, head.encode()))  # no body is ever sent
    assert status == 413 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == INVALID_REQUEST
    assert "1000 bytes" in body["error"]["message"]


@pytest.mark.parametrize("size", [17_000, 70_000])
def test_a_request_head_over_16_kib_is_431_even_when_it_arrives_at_once(
    ar_server: LiveServer, size: int
) -> None:
    """uvicorn's bound on a head holds only while the head arrives in pieces; one written in a
    single send passed it at any size until the middleware measured the whole head."""
    from service.limits import MAX_HEADER_BYTES

    body = json.dumps({"model": MODEL_NAME, "prompt": "a", "max_tokens": 1}).encode()
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nX-Big: {'b' * size}\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    status, headers, reply = _raw_status(_raw(ar_server, head.encode() + body))
    assert status == 431 and headers["connection"] == "close"
    assert reply["error"]["code"] == "request_header_fields_too_large"
    assert f"limit of {MAX_HEADER_BYTES}" in reply["error"]["message"]
    with ar_server.http() as http:  # a head just under the limit is served
        r = http.post(C, content=body, headers={**HEADERS, "X-Big": "b" * (MAX_HEADER_BYTES - 400)})
    assert r.status_code == 200, r.text


def test_a_client_that_sends_its_whole_oversized_body_first_reads_the_413(serve) -> None:
    """No Expect: 100-continue: the body is written in full before the reply is read. The
    server drains it instead of closing on unread data (which resets the connection)."""
    live = serve(max_body_bytes=1000)
    body = json.dumps({"model": MODEL_NAME, "prompt": "a" * 3_000_000}).encode()
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    status, headers, reply = _raw_status(_raw(live, head.encode() + body))
    assert status == 413 and headers["connection"] == "close"
    assert reply["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(serve) -> None:
    live = serve(max_body_bytes=1000)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(10):
            yield b"a" * 200
        yield b'"}'

    with live.http() as http:
        r = http.post(C, content=chunks(), headers=HEADERS)
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert _error(r, 413)["code"] == "request_too_large"


def test_body_within_the_limit_is_served(serve) -> None:
    live = serve(max_body_bytes=1000)
    body = json.dumps({"model": MODEL_NAME, "prompt": "a" * 500, "max_tokens": 2, "temperature": 0})
    assert _post(live, C, body.encode()).status_code == 200


def test_default_body_limit_is_4_mib(ar_server: LiveServer) -> None:
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: {4 * 2**20 + 1}\r\n\r\n"
    assert _raw_status(_raw(ar_server, head.encode()))[0] == 413


def test_body_shorter_than_its_content_length_times_out_with_408(serve) -> None:
    live = serve(body_read_timeout=0.5)
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    t0 = time.monotonic()
    status, headers, body = _raw_status(_raw(live, head.encode() + b'{"model": "tin', timeout=10))
    assert time.monotonic() - t0 < 5
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout"
    assert live.engine.snapshot().alive


def test_slow_but_steady_body_within_the_timeout_is_served(serve) -> None:
    live = serve(body_read_timeout=3.0)

    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny-llama", "prompt": "Hello",'
        time.sleep(0.3)
        yield b' "max_tokens": 2, "temperature": 0}'

    with live.http() as http:
        assert http.post(C, content=chunks(), headers=HEADERS).status_code == 200


def test_serve_passes_keep_alive_and_header_limits_to_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn

    from service import server
    from service.config import ServeConfig

    seen: dict[str, Any] = {}
    engine, model = SimpleNamespace(method="ar"), SimpleNamespace(name="m")
    fake = SimpleNamespace(app=object(), engine=engine, model=model, keeper=None)  # a Built, no state kept
    monkeypatch.setattr(server, "build", lambda config, progress=True, log=None: fake)
    monkeypatch.setattr(server, "curl_example", lambda host, port, model: "curl ...")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    server.serve(ServeConfig(port=9001))
    assert seen["port"] == 9001 and seen["timeout_keep_alive"] == server.KEEP_ALIVE_S
    assert seen["h11_max_incomplete_event_size"] == server.MAX_HEADER_BYTES


def test_body_limit_flags_and_config_keys(tmp_path) -> None:
    from evospec.cli import build_parser
    from service.command import serve_config
    from service.config import ConfigError, ServeConfig, load_config

    args = build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--body-read-timeout", "2.5"])
    config = serve_config(args)
    assert (config.max_body_bytes, config.body_read_timeout) == (1000, 2.5)
    assert (ServeConfig().max_body_bytes, ServeConfig().body_read_timeout) == (4 * 2**20, 30.0)
    path = tmp_path / "c.yaml"
    path.write_text("max_body_bytes: 2048\nbody_read_timeout: 5\n")
    assert load_config(path).max_body_bytes == 2048
    for text, needle in [
        ("max_body_bytes: 0\n", "max_body_bytes must be >= 1"),
        ("body_read_timeout: 0\n", "> 0"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_config(path)


# -- prompt length bound and tokenisation off the event loop -------------------------------------
def test_prompt_longer_than_the_context_can_hold_is_refused_before_tokenising(
    ar_server: LiveServer, codec, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kw: Any) -> list[int]:
        raise AssertionError("the prompt was tokenised")

    monkeypatch.setattr(codec, "encode", never)
    monkeypatch.setattr(codec, "encode_text", never)
    huge = "a" * 1_000_000  # 256 tokens of at most 81 bytes each cannot hold it
    body = json.dumps({"model": MODEL_NAME, "prompt": huge}).encode()
    err = _error(_post(ar_server, C, body), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": huge}]}
    err = _error(_post(ar_server, CHAT, json.dumps(chat).encode()), 400, "messages")
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", [C, CHAT])
def test_health_answers_while_a_prompt_is_tokenised(
    ar_server: LiveServer, codec, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    entered, release = threading.Event(), threading.Event()
    name = "encode" if path == C else "encode_text"
    original = getattr(codec, name)

    def slow(text: str) -> list[int]:
        entered.set()
        release.wait(10)
        return original(text)

    monkeypatch.setattr(codec, name, slow)
    if path == C:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    else:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: result.update(r=_post(ar_server, path, json.dumps(body).encode()))
    )
    worker.start()
    try:
        assert entered.wait(10)
        with ar_server.http(timeout=3.0) as http:
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            assert time.monotonic() - t0 < 1.0
    finally:
        release.set()
        worker.join(20)
    assert result["r"].status_code == 200, result["r"].text


def test_chars_per_token_bound_holds_only_where_provable(codec) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from evospec.tokenizer import TextCodec
    from service.prompting import chars_per_token_bound

    def bound(model, normalizer=None, pre=None) -> int | None:
        tok = Tokenizer(model)
        if normalizer is not None:
            tok.normalizer = normalizer
        if pre is not None:
            tok.pre_tokenizer = pre
        return chars_per_token_bound(TextCodec(tok, None, {}))

    def bpe(**kw: Any):
        return models.BPE({"a": 0, "b": 1, "ab": 2, "abb": 3}, [("a", "b"), ("ab", "b")], **kw)

    assert chars_per_token_bound(codec) == 81  # SmolLM2's longest entry: a newline and 80 spaces
    assert bound(bpe()) == 3
    assert bound(bpe(), pre=pre_tokenizers.ByteLevel()) == 3
    assert bound(bpe(), normalizers.NFC()) == 12  # composition folds up to 4 code points into 1
    assert bound(bpe(), normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "_")])) == 12
    assert bound(bpe(), normalizers.Replace("ab", "c")) is None  # shrinks the text
    assert bound(bpe(), normalizers.Strip()) is None
    assert bound(bpe(), pre=pre_tokenizers.Whitespace()) is None  # drops whitespace
    assert bound(bpe(unk_token="b", fuse_unk=True)) is None  # one unknown token for a whole run
    assert bound(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")) is None

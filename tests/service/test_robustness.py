"""The engine under trouble, through a live server: a failing request does not take the engine
down, a full queue answers 503 + Retry-After, a client that disconnects cancels its generation
between rounds, and a request past its deadline ends with 504."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from evospec.decoding.methods import make_decoder
from tests.service.helpers import MODEL_NAME, FailingDecoder, GateDecoder, SlowDecoder, wait_for

PROMPT = "Once upon a time"


def _ar(tiny, codec):
    return make_decoder("ar", tiny, eos_ids=codec.eos_ids)


@pytest.mark.parametrize("after", [0, 3])
def test_engine_survives_a_failing_request(serve, tiny, codec, reference, after: int) -> None:
    trigger = codec.encode("Boom")[0]
    live = serve(FailingDecoder(_ar(tiny, codec), trigger=trigger, after=after))
    client = live.openai()
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(
            model=MODEL_NAME, prompt="Boom goes the engine", max_tokens=8, temperature=0
        )
    err = info.value.body
    assert (
        info.value.status_code == 500 and err["code"] == "generation_failed" and err["type"] == "server_error"
    )
    assert "injected decoder failure" in err["message"]
    # streaming: the failure arrives as an SSE error event
    with pytest.raises(openai.APIError):
        list(
            client.completions.create(
                model=MODEL_NAME, prompt="Boom again", max_tokens=8, temperature=0, stream=True
            )
        )
    # ... and the engine thread is still serving, with correct output
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == reference(codec.encode(PROMPT), 6)
    assert wait_for(lambda: live.engine.snapshot().outcomes["finished"] == 1)
    snap = live.engine.snapshot()
    assert snap.alive and snap.outcomes["failed"] == 2
    with live.http() as http:
        assert http.get("/health").json()["status"] == "ok"


def test_queue_full_answers_503_with_retry_after(serve, tiny, codec, reference) -> None:
    gate = GateDecoder(_ar(tiny, codec))
    live = serve(gate, max_queue=1)
    results: dict[str, httpx.Response] = {}

    def post(key: str) -> None:
        with live.http() as http:
            results[key] = http.post("/v1/completions", json=_body(4))

    threads = [threading.Thread(target=post, args=("running",))]
    threads[0].start()
    assert wait_for(lambda: live.engine.snapshot().active)  # held at the gate
    threads.append(threading.Thread(target=post, args=("queued",)))
    threads[1].start()
    assert wait_for(lambda: live.engine.snapshot().queue_depth == 1)
    with live.http() as http:
        r = http.post("/v1/completions", json=_body(4))
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "queue_full"
    gate.gate.set()
    for t in threads:
        t.join(20)
    expected = reference(codec.encode(PROMPT), 4)
    assert [results[k].json()["choices"][0]["text"] for k in ("running", "queued")] == [expected, expected]
    assert live.engine.snapshot().rejected == 1
    with live.http() as http:
        assert "evospec_requests_rejected_total 1.0" in http.get("/metrics").text


def test_disconnect_mid_stream_cancels_generation(serve, tiny, codec) -> None:
    live = serve(SlowDecoder(_ar(tiny, codec), delay_s=0.02))
    n = 120  # ~2.4 s if nobody stopped it
    with live.http() as http, http.stream("POST", "/v1/completions", json={**_body(n), "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert all(not line or line.startswith("data: ") for line in got)
    # leaving the block closed the connection mid-stream
    assert wait_for(lambda: live.engine.snapshot().outcomes["disconnected"] == 1, timeout=10)
    snap = live.engine.snapshot()
    assert snap.stats.tokens < n and not snap.active


def test_disconnect_while_waiting_non_streaming_cancels(serve, tiny, codec) -> None:
    live = serve(SlowDecoder(_ar(tiny, codec), delay_s=0.02))
    n = 120
    with live.http(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=_body(n))
    assert wait_for(lambda: live.engine.snapshot().outcomes["disconnected"] == 1, timeout=10)
    assert live.engine.snapshot().stats.tokens < n


def test_request_timeout_gives_504(serve, tiny, codec) -> None:
    live = serve(SlowDecoder(_ar(tiny, codec), delay_s=0.05), request_timeout=0.5)
    t0 = time.monotonic()
    with live.http() as http:
        r = http.post("/v1/completions", json=_body(100))
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 5
    assert wait_for(lambda: live.engine.snapshot().outcomes["timeout"] == 1)
    assert live.engine.snapshot().stats.tokens < 100


def _body(max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}

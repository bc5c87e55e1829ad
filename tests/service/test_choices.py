"""``n`` choices per request: one engine request each, generated together where the engine
batches; streamed chunks name their choice; usage counts the prompt once; a request gets all
its choices queued or none."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from evospec.decoding.methods import make_decoder
from tests.service.helpers import (
    MODEL_NAME,
    GateDecoder,
    LiveServer,
    ar_ids,
    batching_target,
    start_server,
    wait_for,
)

PROMPT = "Tell me about the sea"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def _post(live: LiveServer, path: str, body: dict) -> httpx.Response:
    with live.http() as http:
        return http.post(path, json={"model": MODEL_NAME, **body})


def test_greedy_choices_are_each_plain_decodings_answer(ar_server: LiveServer, codec, reference) -> None:
    ids = codec.encode(PROMPT)
    r = _post(ar_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 9, "temperature": 0, "n": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [reference(ids, 9)] * 3
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 27
    assert body["evospec"]["rounds"] == 3 * 8  # every choice's rounds


def test_seeded_choices_differ_and_repeat(ar_server: LiveServer) -> None:
    ask = {"messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    one = _post(ar_server, "/v1/chat/completions", ask).json()["choices"][0]["message"]["content"]
    many = [
        c["message"]["content"]
        for c in _post(ar_server, "/v1/chat/completions", {**ask, "n": 4}).json()["choices"]
    ]
    again = [
        c["message"]["content"]
        for c in _post(ar_server, "/v1/chat/completions", {**ask, "n": 4}).json()["choices"]
    ]
    assert many[0] == one  # choice 0 draws what a one-choice request with the seed draws
    assert len(set(many)) == 4 and again == many


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_choices_reassemble_by_index(ar_server: LiveServer, codec, reference, chat: bool) -> None:
    body = {
        "max_tokens": 7,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    ids = codec.encode_chat(CHAT) if chat else codec.encode(PROMPT)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with ar_server.http() as http, http.stream("POST", path, json={"model": MODEL_NAME, **body}) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    texts, finishes, roles = {0: "", 1: ""}, {}, []
    for chunk in lines:
        for c in chunk["choices"]:
            part = c["delta"] if chat else c
            texts[c["index"]] += (part.get("content") if chat else part.get("text")) or ""
            if chat and part.get("role"):
                roles.append(c["index"])
            if c["finish_reason"]:
                finishes[c["index"]] = c["finish_reason"]
    assert texts == {0: reference(ids, 7), 1: reference(ids, 7)}
    assert finishes == {0: "length", 1: "length"} and roles == ([0, 1] if chat else [])
    assert lines[-1]["usage"]["completion_tokens"] == 14 and lines[-1]["usage"]["prompt_tokens"] == len(ids)


def test_a_request_whose_choices_do_not_fit_the_queue_gets_none(serve, tiny, codec, reference) -> None:
    gate = GateDecoder(make_decoder("ar", tiny, eos_ids=codec.eos_ids))
    live = serve(gate, max_queue=2)
    held: dict[str, httpx.Response] = {}
    t = threading.Thread(
        target=lambda: held.update(r=_post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3}))
    )
    t.start()
    assert wait_for(lambda: live.engine.snapshot().active)  # held at the gate; the queue is empty
    r = _post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    gate.gate.set()
    t.join(20)
    assert held["r"].status_code == 200
    assert wait_for(lambda: live.engine.snapshot().queue_depth == 0 and not live.engine.snapshot().active)
    outcomes = live.engine.snapshot().outcomes
    assert outcomes["finished"] == 1 and outcomes["disconnected"] == 2  # the two queued ones never ran on
    ok = _post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 0})
    assert [c["text"] for c in ok.json()["choices"]] == [reference(codec.encode(PROMPT), 3)] * 2


def test_choices_are_generated_together_on_a_batching_engine(codec) -> None:
    model = batching_target(codec)
    server = start_server(make_decoder("ar", model, eos_ids=codec.eos_ids), codec, model, max_batch=4)
    most = []
    server.engine.add_step_listener(lambda ev: most.append(server.engine.snapshot().running))
    try:
        r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "n": 4})
        want = codec.decode(ar_ids(model, codec, codec.encode(PROMPT), 16))
        assert [c["text"] for c in r.json()["choices"]] == [want] * 4
        assert max(most) > 1
    finally:
        server.stop()

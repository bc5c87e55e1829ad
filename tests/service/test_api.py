"""The OpenAI-compatible API through the official ``openai`` client against a live server:
outputs equal plain greedy decoding computed directly, streaming reassembles to the same text,
usage and finish_reason are right, stop strings truncate like OpenAI, seeds repeat."""

from __future__ import annotations

import pytest

from tests.service.helpers import CONTEXT, MODEL_NAME, LiveServer, wait_for

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Say something about speculative decoding."}]


def test_models_list(ar_server: LiveServer) -> None:
    models = ar_server.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["context_window"] == CONTEXT


def test_completion_equals_greedy(ar_server: LiveServer, codec, reference) -> None:
    ids = codec.encode(PROMPT)
    r = ar_server.openai().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(ids, 12)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )
    spec = r.model_extra["evospec"]
    assert spec["method"] == "ar" and spec["rounds"] == 11 and spec["accepted"] == 0 and spec["mal"] == 1.0
    assert spec["coverage"] is None and spec["active_vocab_size"] is None and spec["oov_events"] is None


def test_token_id_prompt(ar_server: LiveServer, codec, reference) -> None:
    ids = codec.encode(PROMPT)
    r = ar_server.openai().completions.create(model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == reference(ids, 5)


def test_chat_equals_greedy(ar_server: LiveServer, codec, reference) -> None:
    ids = codec.encode_chat(CHAT)
    r = ar_server.openai().chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == reference(ids, 10)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    assert r.model_extra["evospec"]["method"] == "ar"


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_reassembles(ar_server: LiveServer, codec, reference, chat: bool) -> None:
    client = ar_server.openai()
    opts = {"include_usage": True}
    if chat:
        ids = codec.encode_chat(CHAT)
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=14, temperature=0, stream=True, stream_options=opts
        )
    else:
        ids = codec.encode(PROMPT)
        stream = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=14, temperature=0, stream=True, stream_options=opts
        )
    chunks = list(stream)
    texts = [(c.choices[0].delta.content if chat else c.choices[0].text) or "" for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "".join(texts) == reference(ids, 14)
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 14
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.model_extra["evospec"]["rounds"] == 13


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates(ar_server: LiveServer, codec, reference, stream: bool) -> None:
    ids = codec.encode(PROMPT)
    full = reference(ids, 24)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a piece from the middle of the greedy text
    expected = full[: full.index(stop)]
    before = dict(ar_server.engine.snapshot().outcomes)
    client = ar_server.openai()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    if stream:
        chunks = list(client.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        assert reason == ["stop"]
    else:
        r = client.completions.create(**kw)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 24
        # the tokens up to the one that completed the stop string
        n = r.usage.completion_tokens
        assert stop in codec.decode(_greedy_ids(ar_server, codec, ids)[:n])
    assert text == expected

    # The engine notices the cancellation between rounds, possibly after the response went out;
    # when it ran ahead to max_tokens before the handler found the stop string (the engine
    # thread does not wait for the HTTP side), it ended the request as finished instead.
    def ended() -> str | None:
        now = ar_server.engine.snapshot().outcomes
        grew = [k for k in ("stop_string", "finished") if now[k] == before[k] + 1]
        return grew[0] if grew else None

    assert wait_for(lambda: ended() is not None)


def _greedy_ids(server: LiveServer, codec, ids: list[int]) -> list[int]:
    from tests.service.helpers import ar_ids

    return ar_ids(server.engine.decoder.model, codec, ids, 24)


def test_seeded_sampling_repeats(ar_server: LiveServer) -> None:
    client = ar_server.openai()
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b

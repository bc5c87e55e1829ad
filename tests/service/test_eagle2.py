"""Method eagle2 through the API: a random EAGLE head drafts, the target verifies, and the
text equals plain greedy decoding (non-streaming, streaming chat, stop strings); the response
carries the speculative stats."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import make_decoder
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from tests.service.helpers import MODEL_NAME, LiveServer

PROMPTS = ["The quick brown fox", "In the beginning", "def fibonacci(n):"]


@pytest.fixture
def eagle_server(serve, tiny, codec) -> LiveServer:
    head = new_eagle_for(tiny, seed=3)
    tree = TreeConfig(top_k=4, depth=3, total_tokens=8)
    return serve(make_decoder("eagle2", tiny, eos_ids=codec.eos_ids, draft=head, tree=tree))


def test_eagle2_equals_greedy(eagle_server: LiveServer, codec, reference) -> None:
    client = eagle_server.openai()
    rounds = accepted = 0
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == reference(codec.encode(prompt), 20)
        assert r.usage.completion_tokens == 20
        spec = r.model_extra["evospec"]
        assert spec["method"] == "eagle2" and 1 <= spec["rounds"] <= 19
        assert spec["mal"] == pytest.approx(1 + spec["accepted"] / spec["rounds"], abs=1e-4)
        rounds, accepted = rounds + spec["rounds"], accepted + spec["accepted"]
    snap = eagle_server.engine.snapshot()
    assert (snap.stats.rounds, snap.stats.accepted) == (rounds, accepted)


def test_eagle2_streaming_chat_and_stop(eagle_server: LiveServer, codec, reference) -> None:
    client = eagle_server.openai()
    messages = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}]
    ids = codec.encode_chat([{"role": "user", "content": "Tell me a story."}])
    expected = reference(ids, 24)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    stop = expected[10:13]
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0, stop=stop
    )
    assert r.choices[0].message.content == expected[: expected.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_eagle2_seeded_sampling_repeats(eagle_server: LiveServer) -> None:
    client = eagle_server.openai()
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0.8, seed=11)
    first = client.completions.create(**kw)
    assert first.choices[0].text == client.completions.create(**kw).choices[0].text
    assert first.usage.completion_tokens == 16

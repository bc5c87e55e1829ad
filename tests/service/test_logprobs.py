"""``logprobs`` through the OpenAI API: chat's ``logprobs``/``top_logprobs`` and completions'
``logprobs``, streamed or not, equal to the target's raw log-softmax at each generated token,
cut where a stop string cuts the text, the same under a speculative method."""

from __future__ import annotations

import json

import pytest
import torch

from evospec.decoding.logprobs import row_logprobs
from evospec.decoding.methods import make_decoder
from evospec.decoding.tree import TreeConfig
from tests.service.helpers import MODEL_NAME, LiveServer, api_error, ar_ids, perfect_draft_decoder, post_ok

CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "Colours: red,"


def _expected(tiny, prompt: list[int], tokens: list[int], top: int):
    ids = [*prompt, *tokens]
    cache = tiny.new_cache(len(ids))
    with torch.inference_mode():
        logits = tiny(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="all").logits[0]
    return row_logprobs(logits[len(prompt) - 1 : -1], tokens, top)


def _chat(live: LiveServer, **kw) -> dict:
    return post_ok(live, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 9, "temperature": 0, **kw})


def test_chat_logprobs_are_the_targets_at_each_token(ar_server: LiveServer, codec, tiny) -> None:
    prompt = codec.encode_chat(CHAT)
    tokens = ar_ids(tiny, codec, prompt, 9)
    body = _chat(ar_server, logprobs=True, top_logprobs=3)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == len(tokens)
    for entry, tok, want in zip(content, tokens, _expected(tiny, prompt, tokens, 3), strict=True):
        assert bytes(entry["bytes"]) == codec.token_bytes(tok) and entry["token"] == codec.token_text(tok)
        assert entry["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert [bytes(t["bytes"]) for t in entry["top_logprobs"]] == [
            codec.token_bytes(i) for i, _ in want.top
        ]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [v for _, v in want.top], abs=1e-4
        )
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the best token
    plain = _chat(ar_server, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in plain] == [[]] * len(tokens)
    assert _chat(ar_server)["choices"][0]["logprobs"] is None


def test_streamed_chat_logprobs_add_up_to_the_whole(ar_server: LiveServer) -> None:
    whole = _chat(ar_server, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 9, "temperature": 0, "stream": True}
    body.update(logprobs=True, top_logprobs=2)
    with ar_server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    chunks = [c["choices"][0] for c in lines if c["choices"]]
    streamed = [e for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == whole
    assert all(
        c.get("logprobs") for c in chunks if c["delta"].get("content")
    )  # text and its logprobs together


def test_completion_logprobs_columns(ar_server: LiveServer, codec, tiny) -> None:
    prompt = codec.encode(PROMPT)
    tokens = ar_ids(tiny, codec, prompt, 7)
    r = ar_server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    want = _expected(tiny, prompt, tokens, 2)
    assert lp.tokens == [codec.token_text(t) for t in tokens]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs] == [[codec.token_text(i) for i, _ in w.top] for w in want]
    starts = [0]
    for text in lp.tokens[:-1]:
        starts.append(starts[-1] + len(text))
    assert lp.text_offset == starts
    none = ar_server.openai().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, logprobs=0)
    assert none.choices[0].logprobs.top_logprobs is None and len(none.choices[0].logprobs.tokens) == 3


def test_streamed_completion_offsets_run_across_chunks(ar_server: LiveServer) -> None:
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    whole = ar_server.openai().completions.create(**kw).choices[0].logprobs
    chunks = [
        c.choices[0].logprobs for c in ar_server.openai().completions.create(stream=True, **kw) if c.choices
    ]
    chunks = [c for c in chunks if c is not None]
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset


@pytest.mark.parametrize("method", ["ar", "perfect-draft"])
def test_a_stop_string_cuts_the_logprobs_with_the_text(serve, codec, tiny, method: str) -> None:
    """A draft that is always right commits four tokens a round: the logprobs of those past
    the stop string go with them."""
    live = serve() if method == "ar" else serve(perfect_draft_decoder(tiny, codec))
    prompt = codec.encode(PROMPT)
    tokens = ar_ids(tiny, codec, prompt, 40)
    texts = [codec.decode(tokens[: i + 1]) for i in range(len(tokens))]
    pieces = [texts[i][len(texts[i - 1]) :].strip() for i in range(1, len(tokens))]
    # a stop string the text first meets inside a round (4 tokens a round after the first token)
    cut = next(
        i for i in range(12, len(tokens)) if i % 4 and pieces[i - 1] and pieces[i - 1] not in texts[i - 1]
    )
    stop = pieces[cut - 1]
    r = live.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, logprobs=0, stop=[stop]
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "stop"
    assert lp.tokens == [codec.token_text(t) for t in tokens[: r.usage.completion_tokens]]
    assert r.usage.completion_tokens <= cut + 1
    if method != "ar":
        assert r.model_extra["evospec"]["accepted"] > 0


def test_a_speculative_server_reports_what_plain_decoding_reports(
    serve, ar_server: LiveServer, tiny, codec, head
):
    live = serve(
        make_decoder("eagle2", tiny, eos_ids=codec.eos_ids, draft=head, tree=TreeConfig(top_k=2, depth=3))
    )
    spec = _chat(live, logprobs=True, top_logprobs=2, max_tokens=16)
    plain = _chat(ar_server, logprobs=True, top_logprobs=2, max_tokens=16)
    assert spec["evospec"]["method"] == "eagle2"
    a, b = spec["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in a] == [e["bytes"] for e in b]
    assert [e["logprob"] for e in a] == pytest.approx([e["logprob"] for e in b], abs=1e-4)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_logprobs_requests_are_refused(ar_server: LiveServer, path: str, extra: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 2, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    with ar_server.http() as http:
        r = http.post(path, json=body)
    err = api_error(r, 400, "invalid_value")
    assert err["param"] == param


def _teacher(tiny, ids: list[int], top: int):
    return _expected(tiny, ids[:1], ids[1:], top)


def test_echo_returns_the_prompt_and_its_logprobs_before_the_completion(
    ar_server: LiveServer, codec, tiny
) -> None:
    ids = codec.encode(PROMPT)
    tokens = ar_ids(tiny, codec, ids, 3)
    plain = ar_server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    assert plain.choices[0].text == PROMPT + codec.decode(tokens) and plain.choices[0].logprobs is None
    r = ar_server.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == PROMPT + codec.decode(tokens)
    assert lp.tokens == [codec.token_text(t) for t in [*ids, *tokens]]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [*_teacher(tiny, ids, 2), *_expected(tiny, ids, tokens, 2)]
    assert lp.token_logprobs[1:] == pytest.approx([w.logprob for w in want], abs=1e-4)
    assert [list(d) for d in lp.top_logprobs[1:]] == [[codec.token_text(i) for i, _ in w.top] for w in want]
    starts = [0]
    for text in lp.tokens[:-1]:
        starts.append(starts[-1] + len(text))
    assert lp.text_offset == starts
    assert r.usage.completion_tokens == 3 and r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_zero_with_echo_scores_the_prompt_only(
    ar_server: LiveServer, codec, tiny, stream: bool
) -> None:
    """What lm-evaluation-harness sends for loglikelihood: the prompt's logprobs, no tokens."""
    ids = codec.encode(PROMPT)
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 0,
        "echo": True,
        "logprobs": 1,
        "stream": stream,
    }
    with ar_server.http() as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            choices = [c["choices"][0] for c in lines if c["choices"]]
            text = "".join(c["text"] for c in choices)
            lps = [c["logprobs"] for c in choices if c["logprobs"]]
            assert len(lps) == 1
            lp, reason = lps[0], choices[-1]["finish_reason"]
        else:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text, lp, reason = choice["text"], choice["logprobs"], choice["finish_reason"]
            assert r.json()["usage"]["completion_tokens"] == 0
    assert text == PROMPT and reason == "length"
    assert lp["tokens"] == [codec.token_text(t) for t in ids]
    assert lp["token_logprobs"][1:] == pytest.approx([w.logprob for w in _teacher(tiny, ids, 1)], abs=1e-4)


def test_echo_refuses_several_choices_and_max_tokens_zero_needs_echo(ar_server: LiveServer) -> None:
    with ar_server.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "echo": True, "n": 2})
        assert api_error(r, 400, "unsupported_parameter")["param"] == "echo"
        r = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0})
        assert api_error(r, 400, "invalid_value")["param"] == "max_tokens"

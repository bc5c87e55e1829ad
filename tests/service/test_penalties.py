"""Presence / frequency penalties and ``logit_bias`` through the OpenAI API: applied as plain
decoding with the same settings applies them, under every method; bad values are 400s."""

from __future__ import annotations

import pytest

from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from tests.decoding.spec_helpers import ar_tokens
from tests.service.helpers import MODEL_NAME, LiveServer, api_error, complete, perfect_draft_decoder

PROMPT = "Once upon a time"


@pytest.mark.parametrize("method", ["ar", "perfect-draft"])
def test_penalties_and_bias_follow_plain_decoding_with_them(serve, codec, tiny, method: str) -> None:
    live = serve() if method == "ar" else serve(perfect_draft_decoder(tiny, codec))
    ids = codec.encode(PROMPT)
    pen = Penalties(presence=0.6, frequency=1.1, bias=((198, 20.0),))  # newlines, until they count
    want = ar_tokens(tiny, ids, SamplingParams(max_new_tokens=24, penalties=pen), codec.eos_ids)
    body = complete(live, PROMPT, 24, presence_penalty=0.6, frequency_penalty=1.1, logit_bias={"198": 20.0})
    assert body["choices"][0]["text"] == codec.decode(want)
    biased = complete(live, PROMPT, 24, logit_bias={"198": 20.0})["choices"][0]["text"]
    assert 1 < body["choices"][0]["text"].count("\n") < biased.count("\n")  # the penalties bite
    rep = Penalties(repetition=1.5)
    want = ar_tokens(tiny, ids, SamplingParams(max_new_tokens=24, penalties=rep), codec.eos_ids)
    assert complete(live, PROMPT, 24, repetition_penalty=1.5)["choices"][0]["text"] == codec.decode(want)
    forced = complete(live, PROMPT, 4, logit_bias={"34": 100})
    assert forced["choices"][0]["text"] == codec.decode([34] * 4)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 20: 1}}, "logit_bias"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # past int()'s 4,300 digits
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ],
)
def test_bad_penalties_are_refused(ar_server: LiveServer, extra: dict, param: str) -> None:
    with ar_server.http() as http:
        r = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, **extra}
        )
    assert api_error(r, 400, "invalid_value")["param"] == param

"""Prefix reuse through the server: a chat's next turn reports the prompt tokens it reused
(``usage.prompt_tokens_details.cached_tokens``, ``/metrics``) and answers what a fresh
engine answers."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import make_decoder
from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.tokenizer import TextCodec
from tests.decoding.spec_helpers import tiny_target
from tests.service.helpers import CONTEXT, MODEL_NAME, metric_value, start_server

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)


@pytest.fixture(scope="module")
def fused(codec: TextCodec):
    model = tiny_target(1, ctx=CONTEXT, vocab=codec.vocab_size, eos=codec.eos_ids, head_dim=64)
    quantize_linears(model, "int4")
    model.exact_rows = True
    assert enable_fused_ops(model)
    return model


def _chat(live, messages, n=12):
    with live.http() as http:
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": n, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chats_next_turn_reuses_the_conversation_and_answers_as_a_fresh_server(codec, fused):
    live = start_server(make_decoder("ar", fused, eos_ids=codec.eos_ids), codec, fused)
    fresh = start_server(make_decoder("ar", fused, eos_ids=codec.eos_ids), codec, fused)
    try:
        messages = [{"role": "user", "content": "Name a colour."}]
        first = _chat(live, messages)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        answer = first["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another?"}]
        second = _chat(live, messages)
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # at least the first turn's prompt (the template re-encodes the answer's text, so the
        # answer's own tokens may or may not match what was generated)
        assert first["usage"]["prompt_tokens"] - 1 <= cached < second["usage"]["prompt_tokens"]
        assert second["choices"][0]["message"] == _chat(fresh, messages)["choices"][0]["message"]
        with live.http() as http:
            text = http.get("/metrics").text
        assert metric_value(text, "evospec_prompt_tokens_cached_total") == cached
    finally:
        live.stop()
        fresh.stop()

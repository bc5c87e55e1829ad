"""Bounded load: 16 concurrent clients (half streaming) get exactly the greedy outputs computed
directly, with no errors; every wait is bounded so the test ends by itself."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

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

CLIENTS = 16
MAX_TOKENS = 12


def _ask(server: LiveServer, i: int) -> str:
    client = server.openai(timeout=30.0)
    prompt = f"Request number {i} asks about"
    if i % 2:
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in stream)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


def test_sixteen_concurrent_clients_match_greedy(ar_server: LiveServer, codec, reference) -> None:
    expected = [reference(codec.encode(f"Request number {i} asks about"), MAX_TOKENS) for i in range(CLIENTS)]
    before = ar_server.engine.snapshot()
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_ask, ar_server, i) for i in range(CLIENTS)]
        got = [f.result(timeout=60) for f in futures]
    assert got == expected
    finished = before.outcomes["finished"] + CLIENTS
    assert wait_for(lambda: ar_server.engine.snapshot().outcomes["finished"] == finished)
    after = ar_server.engine.snapshot()
    assert after.outcomes["failed"] == before.outcomes["failed"] and after.rejected == before.rejected
    assert after.alive and after.queue_depth == 0


def test_concurrent_clients_generated_together_get_greedy_outputs(codec) -> None:
    """The same load on a model the engine batches (int4 on the fused ops, max_batch 4): every
    answer, streamed or not, is plain decoding's, and requests did run together."""
    model = batching_target(codec)
    gate = GateDecoder(make_decoder("ar", model, eos_ids=codec.eos_ids))  # the first waits for the rest
    server = start_server(gate, codec, model, max_batch=4)
    most = []
    server.engine.add_step_listener(lambda ev: most.append(server.engine.snapshot().running))
    try:
        clients = 8
        expected = [
            codec.decode(ar_ids(model, codec, codec.encode(f"Request number {i} asks about"), MAX_TOKENS))
            for i in range(clients)
        ]
        with ThreadPoolExecutor(clients) as pool:
            futures = [pool.submit(_ask, server, i) for i in range(clients)]
            assert wait_for(lambda: server.engine.snapshot().queue_depth == clients - 1, timeout=30)
            gate.gate.set()
            got = [f.result(timeout=60) for f in futures]
        assert got == expected
        assert max(most) > 1 and max(most) <= 4
        assert wait_for(lambda: server.engine.snapshot().outcomes["finished"] == clients)
        assert server.engine.snapshot().running == 0
    finally:
        server.stop()

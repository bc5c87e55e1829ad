"""Bounded load: 16 concurrent clients (half streaming) get exactly the greedy outputs computed
directly, with no errors; every wait is bounded so the test ends by itself."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tests.service.helpers import MODEL_NAME, LiveServer, wait_for

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

"""Fuzz the HTTP API from its own OpenAPI schema (schemathesis, positive and negative examples)
against a live server: no 5xx, every 4xx in the OpenAI error shape, the server healthy after
each request.

The short run (50 examples per operation) is part of the ordinary suite; ``-m slow`` runs a
long one (``EVOSPEC_FUZZ_EXAMPLES`` examples per operation, default 1000).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402

from evospec.decoding.methods import make_decoder  # noqa: E402
from tests.service.helpers import LiveServer, start_server  # noqa: E402

SHORT = settings(
    max_examples=50,
    deadline=10_000,  # ms per example; generation on the tiny model takes milliseconds
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
LONG = settings(SHORT, max_examples=int(os.environ.get("EVOSPEC_FUZZ_EXAMPLES", "1000")))
MODES = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]


@pytest.fixture(scope="module")
def fuzz_server(codec, tiny) -> Iterator[LiveServer]:
    """A server of its own (with a small body limit, so oversized bodies are fuzzed too)."""
    live = start_server(
        make_decoder("ar", tiny, eos_ids=codec.eos_ids), codec, tiny, max_body_bytes=64 * 1024
    )
    yield live
    live.stop()


def _fuzz(live: LiveServer, mode: GenerationMode, budget: settings) -> None:
    """Every operation of the live server's schema, ``mode`` examples (schemathesis's pytest
    plugin does not load schemas from fixtures under pytest 9, so hypothesis drives it here)."""
    api = schemathesis.openapi.from_url(live.url + "/openapi.json")
    labels = {op.ok().label for op in api.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"} <= labels

    @budget
    @given(case=api.as_strategy(mode))
    def run(case) -> None:
        response = case.call(timeout=30)
        status = response.status_code
        assert status < 500, f"{case.method} {case.formatted_path} -> {status}: {response.text[:500]}"
        if status >= 400:
            err = response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, response.text[:500]
            assert err["type"] == "invalid_request_error" and isinstance(err["message"], str)
        health = httpx.get(live.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"

    run()


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_fuzz_api(fuzz_server: LiveServer, mode: GenerationMode) -> None:
    _fuzz(fuzz_server, mode, SHORT)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_fuzz_api_long(fuzz_server: LiveServer, mode: GenerationMode) -> None:
    _fuzz(fuzz_server, mode, LONG)

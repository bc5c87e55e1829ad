"""/health and /metrics: Prometheus text with the engine counters, histograms, the
vocabulary series (0 under ``ar``; measured ones in ``test_vocab.py``), and the
declared-but-not-yet-backed LoRA metrics at 0."""

from __future__ import annotations

import re

from tests.service.helpers import MODEL_NAME, metric_value, wait_for


def test_health(ar_server) -> None:
    with ar_server.http() as http:
        r = http.get("/health")
    assert r.status_code == 200
    assert r.json() | {"queue_depth": 0, "active": False, "running": 0} == {
        "status": "ok",
        "model": MODEL_NAME,
        "method": "ar",
        "idle_work": None,
        "queue_depth": 0,
        "active": False,
        "running": 0,
    }


def test_metrics_exposition(serve) -> None:
    live = serve()
    with live.http() as http:
        r = http.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 5, "temperature": 0}
        )
        assert r.status_code == 200
        http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 0})
        assert wait_for(lambda: live.engine.snapshot().outcomes["finished"] == 1)
        m = http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    assert metric_value(text, 'evospec_requests_total{outcome="finished"}') == 1
    assert metric_value(text, "evospec_generated_tokens_total") == 5
    assert metric_value(text, "evospec_rounds_total") == 4
    assert metric_value(text, "evospec_accepted_tokens_total") == 0
    assert metric_value(text, "evospec_mean_acceptance_length") == 1.0
    assert metric_value(text, "evospec_queue_depth") == 0
    assert metric_value(text, "evospec_request_latency_seconds_count") == 1
    assert metric_value(text, "evospec_time_to_first_token_seconds_count") == 1
    assert metric_value(text, 'evospec_http_responses_total{code="400",route="/v1/completions"}') == 1
    for name in (
        "evospec_oov_events_total",  # ar does not draft: every vocabulary series stays at 0
        "evospec_draft_verified_tokens_total",
        "evospec_draft_covered_tokens_total",
        "evospec_draft_coverage",
        "evospec_retrievals_total",
        "evospec_retrievals_late_total",
        "evospec_retrieval_errors_total",
        "evospec_retrievals_dropped_total",
        "evospec_retrieval_latency_seconds_count",
        "evospec_active_vocab_size_count",
        "evospec_lora_updates_total",
        "evospec_lora_update_failures_total",
    ):
        assert metric_value(text, name) == 0
    assert metric_value(text, "evospec_adapter_version") == 0  # ar does not adapt
    assert not re.findall(r"^# HELP (evospec_\w+) NOT YET BACKED", text, re.M)  # every series is backed

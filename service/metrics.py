"""Prometheus metrics of one server, in its own registry (several apps can live in one process).

Owns: :class:`ServiceMetrics` -- the registry behind ``GET /metrics`` and what fills it:
- read from the engine's counters at scrape time (one source of truth): requests by outcome,
  rejected requests, prompt/generated tokens, rounds, accepted tokens, MAL, queue depth,
  active requests, engine liveness, and the active-vocabulary totals (verified and covered
  tokens, coverage, OOV events, retrieval results / late / errors / dropped);
- observed per speculative round (an engine step listener, from ``StepEvent.vocab``): active
  vocabulary size, retrieval latency of each merged result;
- observed when a request ends (an engine listener): request latency, queue wait, time to
  first token, per-request MAL;
- observed per HTTP response (an ASGI middleware in ``app.py``): responses by route and code;
- read from the online adapter at scrape time (clora, osd, evospec-full; 0 otherwise): updates,
  failed updates (discarded or raised), dropped rounds, replay-buffer fill, adapter version of
  the default key, auxiliary memory.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from evospec.decoding.events import StepEvent
from service.engine import Done, Engine

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
_RETRIEVAL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
_VOCAB_SIZE_BUCKETS = (256, 1024, 2048, 4096, 8192, 12288, 16384, 32768, 65536, 131072, 262144)


class _EngineCollector(Collector):
    """Engine counters as Prometheus families, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _adapter(self) -> Iterator[Metric]:
        a = self.engine.adapter
        st = a.stats if a is not None else None
        yield CounterMetricFamily(
            "evospec_lora_updates",
            "Online draft updates published (clora/evospec-full: LoRA; osd: full parameters)",
            value=st.updates if st else 0,
        )
        yield CounterMetricFamily(
            "evospec_lora_update_failures",
            "Online updates discarded (non-finite or blown-up loss) or raised; the previous adapter stayed",
            value=(st.discarded + st.errors) if st else 0,
        )
        yield CounterMetricFamily(
            "evospec_adapt_dropped_rounds",
            "Verified rounds not recorded for adaptation because the update worker was behind",
            value=st.dropped if st else 0,
        )
        yield GaugeMetricFamily(
            "evospec_adapt_replay_fill",
            "Admitted positions in the default key's replay buffer",
            value=a.buffered() if a is not None else 0,
        )
        yield GaugeMetricFamily(
            "evospec_adapter_version",
            "Published adapter version of the default key (0: the base head)",
            value=a.versions().get("", 0) if a is not None else 0,
        )

    def collect(self) -> Iterator[Metric]:
        s = self.engine.snapshot()
        req = CounterMetricFamily(
            "evospec_requests", "Generation requests that ended, by outcome", labels=["outcome"]
        )
        for outcome, n in s.outcomes.items():
            req.add_metric([outcome], n)
        yield req
        yield CounterMetricFamily(
            "evospec_requests_rejected", "Requests refused because the queue was full (503)", value=s.rejected
        )
        yield CounterMetricFamily(
            "evospec_prompt_tokens", "Prompt tokens of ended requests", value=s.prompt_tokens
        )
        yield CounterMetricFamily(
            "evospec_prompt_tokens_cached",
            "Prompt tokens whose K/V were reused from the previous request (prefix reuse)",
            value=s.stats.cached_tokens,
        )
        yield CounterMetricFamily("evospec_generated_tokens", "Tokens generated", value=s.stats.tokens)
        yield CounterMetricFamily(
            "evospec_rounds",
            "Decoding rounds (draft+verify; ar: decode steps after prefill)",
            value=s.stats.rounds,
        )
        yield CounterMetricFamily(
            "evospec_accepted_tokens", "Draft tokens the target accepted", value=s.stats.accepted
        )
        yield GaugeMetricFamily(
            "evospec_mean_acceptance_length",
            "MAL since start: mean tokens per round, accepted + 1 (ar: 1.0; 0 before the first round)",
            value=s.stats.mal or 0.0,
        )
        yield GaugeMetricFamily("evospec_queue_depth", "Requests waiting for the engine", value=s.queue_depth)
        yield GaugeMetricFamily("evospec_queue_capacity", "Maximum queued requests", value=s.max_queue)
        yield GaugeMetricFamily(
            "evospec_active_requests", "Requests being generated now (batched ones included)", value=s.running
        )
        yield GaugeMetricFamily(
            "evospec_max_batch", "Most requests generated together (1: one at a time)", value=s.max_batch
        )
        yield GaugeMetricFamily("evospec_engine_alive", "1 while the engine thread runs", value=int(s.alive))
        v = s.stats.vocab
        yield CounterMetricFamily(
            "evospec_draft_verified_tokens",
            "Accepted + bonus tokens of speculative rounds (the coverage denominator)",
            value=v.verified,
        )
        yield CounterMetricFamily(
            "evospec_draft_covered_tokens",
            "Verified tokens that were in the round's active draft vocabulary",
            value=v.covered,
        )
        yield GaugeMetricFamily(
            "evospec_draft_coverage",
            "Covered / verified tokens since start (1 for eagle2; 0 before the first speculative round)",
            value=v.coverage or 0.0,
        )
        yield CounterMetricFamily(
            "evospec_oov_events",
            "Rounds whose bonus token was outside the active vocabulary",
            value=v.oov_events,
        )
        yield CounterMetricFamily(
            "evospec_retrievals",
            "OOV retrieval results merged into the ARC buffer (late ones included)",
            value=v.retrievals,
        )
        yield CounterMetricFamily(
            "evospec_retrievals_late",
            "Merged retrieval results that missed the round right after their OOV event",
            value=v.late,
        )
        yield CounterMetricFamily("evospec_retrieval_errors", "OOV retrievals that raised", value=v.errors)
        yield from self._adapter()
        yield CounterMetricFamily(
            "evospec_retrievals_dropped",
            "OOV events not retrieved because max_pending retrievals were in flight",
            value=v.dropped,
        )


class ServiceMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        r = self.registry
        self.latency = Histogram(
            "evospec_request_latency_seconds",
            "Arrival to last token, per generation request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "evospec_queue_wait_seconds",
            "Arrival to start of generation",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "evospec_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_mal = Histogram(
            "evospec_request_mal",
            "Per-request mean acceptance length (requests with at least one round)",
            buckets=(1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
            registry=r,
        )
        self.http = Counter(
            "evospec_http_responses", "HTTP responses by route and status code", ["route", "code"], registry=r
        )
        self.active_vocab_size = Histogram(
            "evospec_active_vocab_size",
            "Ids the draft could propose, per speculative round (eagle2: the full vocabulary)",
            buckets=_VOCAB_SIZE_BUCKETS,
            registry=r,
        )
        self.retrieval_latency = Histogram(
            "evospec_retrieval_latency_seconds",
            "OOV retrieval (target top ids, HNSW, bigram graph), submit to finish, per merged result",
            buckets=_RETRIEVAL_BUCKETS,
            registry=r,
        )
        engine.add_listener(self.observe)
        engine.add_step_listener(self.observe_step)

    def observe_step(self, ev: StepEvent) -> None:
        """Engine step listener: one round's vocabulary facts."""
        if ev.vocab is None:
            return
        self.active_vocab_size.observe(ev.vocab.active_size)
        for latency in ev.vocab.retrieval_s:
            self.retrieval_latency.observe(latency)

    def observe(self, done: Done) -> None:
        """Engine listener: one ended request."""
        self.latency.observe(done.total_s)
        self.queue_wait.observe(done.queue_s)
        if done.first_token_s is not None:
            self.ttft.observe(done.first_token_s)
        if done.stats.mal is not None:
            self.request_mal.observe(done.stats.mal)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

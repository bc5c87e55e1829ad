"""The engine thread: the one thread that owns the model and its decoder.

Owns: a bounded FIFO of typed :class:`GenerationRequest` s, the thread that serves them through
a :class:`~evospec.decoding.methods.Decoder` -- one at a time, or, with ``max_batch`` > 1 where
the model can step several sequences in one forward, together in a
:class:`~evospec.decoding.batch.DecodeBatch` once others wait (below) -- the per-request and
global counters (:class:`~evospec.decoding.stats.RequestStats`, the one fold over step events, per
request and summed over the engine's life; :class:`EngineSnapshot`; the last OOV events), and
*control calls* (:meth:`Engine.call`) that read or change the decoder's state on this thread.
HTTP handlers only validate, build a request and :meth:`Engine.submit` it with a *sink*; the
engine pushes every :class:`~evospec.decoding.events.StepEvent` to that sink, then exactly one
:class:`Done`.

Rules the engine keeps:
- Full queue: :meth:`Engine.submit` raises :class:`EngineBusy` at once (the handler answers 503).
- Cancellation (client gone, stop string found, handler timeout) is a flag on the request,
  checked between rounds: the decoder's generator is closed and the request ends.
- The per-request deadline (arrival + timeout, queue wait included) is checked at dequeue and
  between rounds.
- An exception in one request ends that request only (:attr:`Outcome.FAILED`); the thread goes on.
- Idle work (:meth:`Engine.run_when_idle`, ``service/idle.py``: ``--method auto``'s timings)
  advances only while no request waits or runs, and is paused before each request and control.
- Control calls run at a *safe point*: between two rounds of the running request (the
  decoder's generator is suspended at a ``yield``), between two batched steps, or while the
  engine is idle, never in the middle of a round and never on the caller's thread while the
  engine thread is running.
- Batching (``max_batch`` > 1 and ``batched_steps_apply``): a request that finds the engine
  idle runs alone with the decoder's method. Once another request waits, the running one is
  handed over at its next round boundary -- its committed slots copied into a cache of its own,
  its count, budget and stop rule kept -- and from then on every running request advances one
  token per step in one forward (plain decoding: an extra row costs a fraction of a step on a
  memory-bound CPU, a speculative row's bet does not pay beside it). Waiting requests join
  between steps while fewer than ``max_batch`` run; when the batch empties, the next request
  runs alone again. The last request left in the batch, with nobody waiting, goes back to the
  decoder's method where that is more than a batch of one (``ngram``: its slots kept with the
  prefix store, the decoder resumes it; not a drafted method, whose draft needs features the
  batch does not compute, nor a request whose penalties or JSON grammar read its output). A joining prompt
  prefills in chunks between the running requests' steps.
  Every request's tokens stay those of plain decoding (greedy: identical; sampled: drawn from
  the target's distribution; ``decoding/batch.py``). A batched forward that raises ends every
  request in it (FAILED).

Knows token ids only: no tokenizer, no web framework. The request, outcome, snapshot and sink
types (:class:`AsyncSink`: the bridge from this thread to an asyncio handler) live in
``service/requests.py`` and are re-exported here.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from evospec.adapt.online import OnlineAdapter
from evospec.decoding.batch import PREFILL_CHUNK, DecodeBatch
from evospec.decoding.events import StepEvent
from evospec.decoding.logprobs import prompt_logprobs
from evospec.decoding.methods import Decoder
from evospec.decoding.sampling import SamplingParams, derived_seed
from evospec.decoding.stats import RequestStats
from evospec.models.batch_step import AUTO_BATCH, batch_size, batched_steps_apply
from evospec.vocab.active import ActiveVocab
from service.idle import IdleJob
from service.requests import (  # noqa: F401 (re-exported: what flows through the engine)
    RECENT_OOV,
    AsyncSink,
    Done,
    EngineBusy,
    EngineSnapshot,
    EngineStopped,
    GenerationRequest,
    Item,
    LiveRequest,
    OOVEvent,
    Outcome,
    PromptLogprobs,
    Sink,
    deliver,
    run_control,
)

log = logging.getLogger("evospec.service.engine")
HAND_BACK_MIN_TOKENS = 8  # a lone batched request goes back to the method with at least this many left


class Engine:
    """A bounded FIFO served by one thread that owns ``decoder`` (and so the model). Control
    calls inspect or reset the decoder's active vocabulary and adapter (``Decoder.vocab``,
    ``Decoder.adapt``)."""

    def __init__(
        self,
        decoder: Decoder | None = None,
        *,
        max_queue: int = 64,
        max_batch: int | str = 1,
        prefill_chunk: int = PREFILL_CHUNK,
        listeners: Sequence[Callable[[Done], None]] = (),
    ) -> None:
        """``decoder`` None: it is built on the engine thread by ``start(prepare)``. ``max_batch``:
        the most requests generated together where the decoder's model can (else 1; ``"auto"``:
        ``batch_step.batch_size``'s); ``prefill_chunk``: prompt tokens a joining request
        prefills between two batched steps."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_batch != AUTO_BATCH:  # a clear ValueError now ("auto" is resolved with the model)
            batch_size(max_batch)
        self.decoder: Decoder | None = None
        self.vocab: ActiveVocab | None = None
        self.adapter: OnlineAdapter | None = None
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._batch: DecodeBatch | None = None
        self._members: dict[str, LiveRequest] = {}  # batched requests, by request id (engine thread)
        if decoder is not None:
            self._adopt(decoder)
        self.max_queue = max_queue
        self._listeners = list(listeners)
        self._step_listeners: list[Callable[[StepEvent], None]] = []
        self._controls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._controls_on_thread = False  # the engine thread will run queued control calls
        self._recent_oov: deque[OOVEvent] = deque(maxlen=RECENT_OOV)
        self._queue: queue.Queue[tuple[GenerationRequest, Sink]] = queue.Queue(maxsize=max_queue)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._running = 0  # requests being generated (alone or batched)
        self._submitted = self._rejected = self._prompt_tokens = 0
        self._outcomes: Counter[str] = Counter()
        self._stats = RequestStats()
        self._service_s = 0.0  # moving average of a request's time on the engine
        self._job: IdleJob | None = None  # work done while no request waits (engine thread)

    def _adopt(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.vocab = decoder.vocab
        self.adapter = decoder.adapt
        model = getattr(decoder, "model", None)
        self._batch = None
        if self.max_batch != 1 and model is not None and batched_steps_apply(model):
            size = batch_size(self.max_batch)
            if size > 1:
                self._batch = DecodeBatch(model, getattr(decoder, "eos_ids", ()), size, self.prefill_chunk)

    @property
    def batching(self) -> bool:
        """Whether requests are generated together when several wait (``max_batch`` > 1 and a
        model that steps several sequences in one forward)."""
        return self._batch is not None

    @property
    def method(self) -> str:
        return self.decoder.name

    def add_listener(self, fn: Callable[[Done], None]) -> None:
        """``fn(done)`` runs on the engine thread after each request; exceptions are logged."""
        self._listeners.append(fn)

    def add_step_listener(self, fn: Callable[[StepEvent], None]) -> None:
        """``fn(event)`` runs on the engine thread for each event; must be quick (exceptions are logged)."""
        self._step_listeners.append(fn)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine thread at its next safe point (between two rounds, or when
        idle); the future holds its result or exception. Without a running engine thread nothing
        else can touch the decoder, so ``fn`` runs at once in the caller. A call cancelled before
        it starts never runs."""
        fut: Future = Future()
        with self._lock:
            if self._controls_on_thread:
                self._controls.append((fn, fut))
                return fut
        run_control(fn, fut)
        return fut

    def run_when_idle(self, job: IdleJob) -> None:
        """Advance ``job`` step by step while no request waits or runs (``service/idle.py``),
        pausing it before each request; then serve the decoder its ``done`` returns. Replaces a
        job not finished yet."""

        def install() -> None:
            if self._job is not None:
                self._job.close()
            self._job = job

        self.call(install).result()

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, prepare: Callable[[], Decoder] | None = None) -> None:
        """Start the engine thread (a no-op while it runs). ``prepare``: build the decoder on
        that thread first and return once it is built (its exception is raised here). Serving
        uses this so the thread that runs the model is the one that loaded and tuned it: on a
        CPU, once another thread has run torch's parallel kernels, its OpenMP pool halves the
        engine thread's speed (measured here: int4 AR 105 tok/s on the loading thread, 45 on a
        second one)."""
        if self._thread is not None and self._thread.is_alive():
            return
        if prepare is None and self.decoder is None:
            raise ValueError("an engine without a decoder needs start(prepare)")
        self._stopping.clear()
        with self._lock:
            self._controls_on_thread = True
        ready: Future = Future()
        self._thread = threading.Thread(
            target=self._run, args=(prepare, ready), name="evospec-engine", daemon=True
        )
        self._thread.start()
        ready.result()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current round; queued requests end with :attr:`Outcome.SHUTDOWN`."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._drain()
        if self.decoder is not None:
            self.decoder.close()  # the adapter's worker, the vocabulary's retrieval threads

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    # -- handler side ---------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Enqueue without blocking; raises :class:`EngineBusy` or :class:`EngineStopped`."""
        if not self.alive:
            raise EngineStopped("the engine thread is not running")
        try:
            self._queue.put_nowait((request, sink))
        except queue.Full:
            with self._lock:
                self._rejected += 1
            raise EngineBusy(self._queue.qsize(), self.retry_after_s()) from None
        with self._lock:
            self._submitted += 1

    def retry_after_s(self) -> int:
        """Rough seconds until the queue drains: depth x mean service time (1..60)."""
        est = (self._queue.qsize() + 1) * self._service_s
        return int(min(60, max(1, math.ceil(est))))

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            s = self._stats
            return EngineSnapshot(
                method=self.method,
                alive=self.alive,
                active=self._running > 0,
                running=self._running,
                max_batch=self._batch.capacity if self._batch is not None else 1,
                queue_depth=self._queue.qsize(),
                max_queue=self.max_queue,
                submitted=self._submitted,
                rejected=self._rejected,
                outcomes={o.value: self._outcomes[o.value] for o in Outcome},
                prompt_tokens=self._prompt_tokens,
                stats=s.copy(),
                recent_oov=tuple(self._recent_oov),
                idle_work=self._job.name if self._job is not None else None,
            )

    # -- engine thread --------------------------------------------------------------------------
    def _run(self, prepare: Callable[[], Decoder] | None, ready: Future) -> None:
        try:
            if prepare is not None:
                self._adopt(prepare())
        except BaseException as exc:  # the build failed: start() raises it; nothing was served
            with self._lock:
                self._controls_on_thread = False
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while not self._stopping.is_set():
                self._run_controls()
                if self._members:  # batched requests: let waiting ones join, then one step
                    self._admit_waiting()
                    self._batch_step()
                    self._hand_back()
                    continue
                try:  # with idle work to do, waiting for a request is doing it
                    request, sink = self._queue.get_nowait() if self._job else self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._job is not None:
                        self._idle_step()
                    continue
                try:
                    if self._job is not None:
                        self._idle_step(pause=True)
                    self._serve(request, sink)
                except Exception:  # bookkeeping or a listener broke: never let the thread die
                    log.exception("engine: unexpected error around request %s", request.request_id)
            self._end_members(Outcome.SHUTDOWN, None)
        finally:
            if self._job is not None:
                self._job.close()
                self._job = None
            with self._lock:
                self._controls_on_thread = False
            self._run_controls()  # calls queued before the flag dropped still run, here

    def _idle_step(self, pause: bool = False) -> None:
        """Advance (or pause) the idle job; once it is over, serve the decoder it chose."""
        job = self._job
        if not job.step(pause, serving=self.method):
            return
        self._job = None
        if job.chosen is not None and job.chosen is not self.decoder:
            old = self.decoder
            self._adopt(job.chosen)
            old.close()

    def _run_controls(self) -> None:
        """A safe point: run every queued control call (engine thread only)."""
        if self._controls and self._job is not None:
            self._idle_step(pause=True)
        while self._controls:
            fn, fut = self._controls.popleft()
            run_control(fn, fut)

    def _book(self, request: GenerationRequest, ev: StepEvent, stats: RequestStats) -> None:
        """Book one event before it is delivered: global counters, OOV log, step listeners."""
        oov = ev.vocab is not None and ev.vocab.oov
        with self._lock:
            self._stats.add(ev)
            if oov:
                self._recent_oov.append(OOVEvent(request.request_id, stats.rounds, ev.bonus, time.time()))
        for fn in self._step_listeners:
            try:
                fn(ev)
            except Exception:
                log.exception("engine: step listener failed")

    def _drain(self) -> None:
        while True:
            try:
                request, sink = self._queue.get_nowait()
            except queue.Empty:
                return
            request.cancel(Outcome.SHUTDOWN)
            self._finish(LiveRequest(request, sink, time.monotonic()), Outcome.SHUTDOWN, None)

    def _take(self, request: GenerationRequest, sink: Sink) -> tuple[LiveRequest, Outcome | None]:
        """Start a dequeued request: its live state, and the outcome it already has (cancelled
        while it waited, or past its deadline)."""
        live = LiveRequest(request, sink, time.monotonic(), running=True)
        with self._lock:
            self._running += 1
        outcome = request.cancelled_by
        if outcome is None and live.start > request.deadline:
            outcome = Outcome.TIMEOUT
        return live, outcome

    def _deliver_event(self, live: LiveRequest, ev: StepEvent) -> Outcome | None:
        """Count, book and deliver one event; the outcome it leads to, if any (the request ends)."""
        request = live.request
        if live.first is None:
            live.first = time.monotonic() - request.submitted_at
        live.stats.add(ev)
        live.emitted += ev.tokens
        self._book(request, ev, live.stats)
        if not deliver(live.sink, ev):
            request.cancel(Outcome.DISCONNECTED)
        self._run_controls()
        if ev.finish_reason is not None:
            return Outcome.FINISHED
        if request.cancelled_by is not None:
            return request.cancelled_by
        if time.monotonic() > request.deadline:
            return Outcome.TIMEOUT
        if self._stopping.is_set():
            return Outcome.SHUTDOWN
        return None

    def _serve(self, request: GenerationRequest, sink: Sink) -> None:
        """One request alone with the decoder's method (unless it already has an outcome)."""
        live, outcome = self._take(request, sink)
        if outcome is not None:
            self._finish(live, outcome, None)
            return
        if self._score(live):
            self._alone(live, request.prompt_ids, request.params)

    def _score(self, live: LiveRequest) -> bool:
        """Deliver the prompt's logprobs where the request asks (``echo``: a prefill of its own,
        every row's logits kept); whether it goes on to generate (a failure, or a request that
        only scores, ends here)."""
        request = live.request
        if request.prompt_logprobs is not None:
            try:
                entries = prompt_logprobs(self.decoder.model, request.prompt_ids, request.prompt_logprobs)
            except Exception as exc:
                log.exception("engine: scoring request %s's prompt failed", request.request_id)
                self._finish(live, Outcome.FAILED, f"{type(exc).__name__}: {exc}")
                return False
            if not deliver(live.sink, PromptLogprobs(entries)):
                request.cancel(Outcome.DISCONNECTED)
        if not request.generate or request.cancelled_by is not None:
            self._finish(live, request.cancelled_by or Outcome.FINISHED, None)
            return False
        return True

    def _alone(
        self, live: LiveRequest, prompt: Sequence[int], params: SamplingParams, resumed: bool = False
    ) -> None:
        """Generate ``live``'s request with the decoder's method from ``prompt`` (``resumed``: the
        request's prompt and the tokens it emitted in the batch, whose first event is then a
        step, not a prefill); handed over to the batch between two rounds once another request
        waits (batching on)."""
        request = live.request
        outcome: Outcome | None = None
        error: str | None = None
        events = None
        try:
            if self.adapter is not None:
                self.adapter.select(request.adapter_key)
            events = self.decoder.generate(prompt, params)
            for ev in events:
                if resumed and ev.prefill:  # one token after the kept slots: a plain step
                    ev = replace(ev, prefill=False, cached_tokens=0)
                outcome = self._deliver_event(live, ev)
                if outcome is not None:
                    break
                if self._batch is not None and self._queue.qsize() > 0:
                    events.close()  # the decoder's cache now holds the committed slots
                    error = self._hand_over(live)
                    if error is None:
                        return
                    outcome = Outcome.FAILED
                    break
            else:
                outcome = Outcome.FINISHED  # the decoder ended without a finish reason
        except Exception as exc:
            log.exception("engine: request %s failed", request.request_id)
            outcome, error = Outcome.FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    log.exception("engine: closing the decoder's generator failed")
        self._finish(live, outcome, error)

    # -- batched requests (engine thread) -------------------------------------------------------
    def _hand_over(self, live: LiveRequest) -> str | None:
        """Move a request the decoder began into the batch: its decoder's live cache now holds
        its prompt and emitted tokens but the last (the prefix reuse's bookkeeping), which
        :meth:`_join` copies like any shared prefix; the next step feeds its last token. Returns
        None, or the error that kept it from joining (the request then ends)."""
        request = live.request
        try:
            self._join(request, live.emitted)
        except Exception as exc:
            log.exception("engine: handing request %s over to the batch failed", request.request_id)
            return f"{type(exc).__name__}: {exc}"
        self._members[request.request_id] = live
        return None

    def _hand_back(self) -> bool:
        """The batch's last request goes back to the decoder's method when nobody waits and the
        method is worth more than a batch of one (a speculative decoder without a draft to feed:
        ``ngram``; a drafted one would need features the batch does not compute): its slots are
        kept with the decoder's prefix store, and the decoder resumes it from its prompt and
        emitted tokens with the rest of its budget. Not for a request whose penalties or JSON
        grammar read its output (the decoder would start them from zero). Returns whether it went
        back."""
        prefix = getattr(self.decoder, "prefix", None)
        if len(self._members) != 1 or self._queue.qsize() or prefix is None or not prefix.enabled:
            return False
        if self.decoder.name == "ar" or prefix.needs_features:
            return False
        ((key, live),) = self._members.items()
        member, params = self._batch.members.get(key), live.request.params
        if member is None or not member.ready or params.penalties.history:
            return False
        left = params.max_new_tokens - member.produced
        kept = [*live.request.prompt_ids, *live.emitted[:-1]]  # what its cache holds
        if left < HAND_BACK_MIN_TOKENS or len(kept) < prefix.min_snapshot:
            return False
        self._batch.leave(key)
        del self._members[key]
        prefix.remember(kept, member.cache)  # the decoder's next prepare finds every slot there
        rest = replace(params, max_new_tokens=left, seed=derived_seed(params.seed, member.produced))
        self._alone(live, [*kept, live.emitted[-1]], rest, resumed=True)  # fresh draws for a seeded one
        return True

    def _admit_waiting(self) -> None:
        """Waiting requests join the batch while it has room (their prefill runs in chunks
        between the following steps)."""
        while not self._batch.full:
            try:
                request, sink = self._queue.get_nowait()
            except queue.Empty:
                return
            live, outcome = self._take(request, sink)
            if outcome is not None:
                self._finish(live, outcome, None)
                continue
            if not self._score(live):
                continue
            try:
                self._join(request)
            except Exception as exc:
                log.exception("engine: request %s failed", request.request_id)
                self._finish(live, Outcome.FAILED, f"{type(exc).__name__}: {exc}")
                continue
            self._members[request.request_id] = live

    def _join(self, request: GenerationRequest, emitted: Sequence[int] = ()) -> None:
        """A request into the batch: the slots its prompt (and ``emitted``: tokens the decoder
        produced for it alone) shares with the decoder's live cache or kept sequences copied into
        a cache of its own; the rest prefills chunk by chunk between the batch's steps. Budget,
        stop rule and count stay the original request's."""
        batch, prompt = self._batch, [*request.prompt_ids, *emitted]
        budget = batch.budget(len(request.prompt_ids), request.params)
        cache = batch.model.new_cache(budget.slots)
        prefix = getattr(self.decoder, "prefix", None)
        reuse = prefix.lend(prompt, getattr(self.decoder, "cache", None), cache) if prefix is not None else 0
        key, params = request.request_id, request.params
        batch.join(key, prompt, params, cache=cache, reuse=reuse, emitted=emitted, budget=budget)

    def _after(self, live: LiveRequest, outcome: Outcome | None, error: str | None = None) -> None:
        if outcome is None:
            return
        key = live.request.request_id
        member = self._batch.leave(key)
        del self._members[key]
        prefix = getattr(self.decoder, "prefix", None)
        if member is not None and prefix is not None and outcome is not Outcome.FAILED and live.emitted:
            kept = [*live.request.prompt_ids, *live.emitted[:-1]]  # what its cache holds
            prefix.remember(kept, member.cache)  # for a chat's next turn
        self._finish(live, outcome, error)

    def _batch_step(self) -> None:
        """A prefill chunk of a joining request and one token for every batched request whose
        prompt is in; a forward that raises ends them all (FAILED). Requests cancelled or past
        their deadline leave first (one still prefilling has had no event to notice it by)."""
        now = time.monotonic()
        for live in list(self._members.values()):
            request = live.request
            if request.cancelled_by is not None:
                self._after(live, request.cancelled_by)
            elif now > request.deadline:
                self._after(live, Outcome.TIMEOUT)
        if not self._members:
            return
        try:
            results = self._batch.advance()
        except Exception as exc:
            log.exception("engine: a batched step failed")
            self._end_members(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
            return
        for key, ev in results:
            live = self._members.get(key)
            if live is not None:
                self._after(live, self._deliver_event(live, ev))

    def _end_members(self, outcome: Outcome, error: str | None) -> None:
        for live in list(self._members.values()):
            self._after(live, outcome, error)

    def _finish(self, live: LiveRequest, outcome: Outcome, error: str | None) -> None:
        request = live.request
        now = time.monotonic()
        done = Done(
            outcome=outcome,
            error=error,
            stats=live.stats,
            prompt_tokens=len(request.prompt_ids),
            queue_s=live.start - request.submitted_at,
            first_token_s=live.first,
            total_s=now - request.submitted_at,
        )
        with self._lock:
            self._outcomes[outcome.value] += 1
            self._prompt_tokens += len(request.prompt_ids)
            if live.running:
                self._running -= 1
            self._service_s = 0.8 * self._service_s + 0.2 * (now - live.start)
        deliver(live.sink, done)
        for fn in self._listeners:
            try:
                fn(done)
            except Exception:
                log.exception("engine: listener failed")

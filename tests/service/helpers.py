"""Service test helpers: live uvicorn servers, instrumented decoders and response checks.

A server from :func:`start_server` is a real uvicorn instance on 127.0.0.1 (a random free port)
in a background thread, with its own engine thread; the fixtures that start and stop them
(``serve``, ``ar_server``) and the tiny target they serve are in ``conftest.py``.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from evospec.decoding.events import StepEvent
from evospec.decoding.methods import ARDecoder, Decoder
from evospec.decoding.sampling import SamplingParams
from evospec.models.transformer import Transformer
from evospec.tokenizer import TextCodec
from service.admin import ADMIN_TOKEN_ENV
from service.app import create_app
from service.config import ServeConfig
from service.context import ServedModel
from service.engine import Engine

MODEL_NAME = "tiny-llama"
CONTEXT = 256
MAX_TOKENS_LIMIT = 128


def ar_ids(model: Transformer, codec: TextCodec, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy reference, computed directly (no server)."""
    dec = ARDecoder(model, codec.eos_ids)
    return [t for ev in dec.generate(prompt_ids, SamplingParams(max_new_tokens=n)) for t in ev.tokens]


# -- instrumented decoders --------------------------------------------------------------------------
class WrappedDecoder:
    """Delegates to ``inner``; subclasses hook each event."""

    def __init__(self, inner: Decoder) -> None:
        self.inner = inner
        self.name = inner.name
        self.tree, self.vocab, self.adapt = inner.tree, inner.vocab, inner.adapt  # the Decoder protocol
        self.model, self.eos_ids, self.prefix = inner.model, inner.eos_ids, inner.prefix

    @property
    def cache(self):
        return self.inner.cache

    def close(self) -> None:
        self.inner.close()

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StepEvent]:
        for i, ev in enumerate(self.inner.generate(prompt, params)):
            self.on_event(i, prompt)
            yield ev

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        pass


class FailingDecoder(WrappedDecoder):
    """Raises inside generation for prompts starting with ``trigger``, after ``after`` events."""

    def __init__(self, inner: Decoder, trigger: int, after: int = 0) -> None:
        super().__init__(inner)
        self.trigger, self.after = trigger, after

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        if prompt[0] == self.trigger and index >= self.after:
            raise RuntimeError("injected decoder failure")


class SlowDecoder(WrappedDecoder):
    def __init__(self, inner: Decoder, delay_s: float) -> None:
        super().__init__(inner)
        self.delay_s = delay_s

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        time.sleep(self.delay_s)


class GateDecoder(WrappedDecoder):
    """Holds every request before its first event until ``gate`` is set."""

    def __init__(self, inner: Decoder) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        if index == 0:
            self.gate.wait(30)


# -- live servers -----------------------------------------------------------------------------------
@dataclass
class LiveServer:
    url: str
    engine: Engine
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 20.0), **kw)

    def openai(self, **kw: Any) -> Any:
        from openai import OpenAI

        kw.setdefault("timeout", 30.0)
        return OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)


def start_server(
    decoder: Decoder,
    codec: TextCodec,
    model: Transformer,
    *,
    admin_token: str | None = None,
    **config: Any,
) -> LiveServer:
    cfg = ServeConfig(**{"max_tokens_limit": MAX_TOKENS_LIMIT, "served_model_name": MODEL_NAME, **config})
    batching = {"max_batch": cfg.max_batch, "prefill_chunk": cfg.prefill_chunk}
    engine = Engine(decoder, max_queue=cfg.max_queue, **batching)
    served = ServedModel(
        name=MODEL_NAME,
        codec=codec,
        context_window=model.cfg.max_position_embeddings,
        vocab_size=model.cfg.vocab_size,
        eos_ids=tuple(getattr(decoder, "eos_ids", ())),
    )
    saved = os.environ.pop(ADMIN_TOKEN_ENV, None)
    try:
        if admin_token is not None:
            os.environ[ADMIN_TOKEN_ENV] = admin_token
        app = create_app(engine, served, cfg)
    finally:
        os.environ.pop(ADMIN_TOKEN_ENV, None)
        if saved is not None:
            os.environ[ADMIN_TOKEN_ENV] = saved
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    return LiveServer(f"http://127.0.0.1:{port}", engine, server, thread)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def post_ok(live: LiveServer, path: str, body: dict[str, Any]) -> dict:
    """A JSON POST that must succeed (the served model's name added); the parsed response."""
    with live.http() as http:
        r = http.post(path, json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()


def complete(live: LiveServer, prompt: str, n: int = 20, **extra: Any) -> dict:
    """A greedy ``/v1/completions`` call that must succeed; the parsed response."""
    return post_ok(live, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0, **extra})


def perfect_draft_decoder(model: Transformer, codec: TextCodec) -> Decoder:
    """A speculative decoder whose draft is ``model`` itself on a 3-token chain: every drafted
    token is accepted, so each round commits four tokens."""
    from evospec.decoding.drafter import TargetDrafter
    from evospec.decoding.methods import SpeculativeDecoder
    from evospec.decoding.tree import TreeConfig

    chain = TreeConfig(top_k=1, depth=3, total_tokens=3)
    return SpeculativeDecoder("eagle2", model, TargetDrafter(model), chain, eos_ids=codec.eos_ids)


def batching_target(codec: TextCodec, seed: int = 1) -> Transformer:
    """A tiny target over the real vocabulary that the engine batches (int4 linears on the
    fused ops, recorded steps); skips the test where this CPU cannot step sequences together."""
    import pytest

    from evospec.kernels.cpu_ops import load_cpu_ops
    from evospec.models.batch_step import batched_steps_apply
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import kernels_available, quantize_linears
    from evospec.models.step import StepGraph
    from tests.decoding.spec_helpers import tiny_target

    if not (load_cpu_ops() and kernels_available("int4")):
        pytest.skip("needs the fused CPU ops and int4 kernels")
    model = tiny_target(seed, ctx=CONTEXT, vocab=codec.vocab_size, eos=codec.eos_ids, head_dim=64)
    quantize_linears(model, "int4")
    model.exact_rows = True
    enable_fused_ops(model)
    if not batched_steps_apply(model):
        pytest.skip("batched steps need every linear on our int4 kernel (AVX2 or VNNI)")
    model.step_graph = StepGraph(model)
    return model


def api_error(r: httpx.Response, status: int, code: str) -> dict:
    """The error object of a response that must have failed with ``status`` and ``code``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    return err


def metric_value(text: str, name: str) -> float:
    """The value of the series ``name`` (labels included: ``x{a="b"}``) in a Prometheus text exposition."""
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in metrics"
    return float(m.group(1))

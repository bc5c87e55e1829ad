"""``evospec serve``: load the model named by a :class:`ServeConfig`, build the app, run uvicorn.

Owns: turning a config into a running server -- the decoder stack (``evospec/assembly.py``:
model, tokenizer, draft head, indices, decoder), the :class:`Engine`, the app -- a line per
loaded part and the ready-to-paste curl line, printed to stderr just before uvicorn starts --
and the restart state around uvicorn's run (``persistence.py``: restored before the engine
serves, snapshotted periodically and once more after it stopped). ``--method auto`` (or ``--tree
auto``) not yet measured on this machine serves ``ngram`` (a small chain) at once and is timed
in the engine's idle time (:func:`tuning_job`).
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from fastapi import FastAPI

from service import persistence
from service.config import ServeConfig
from service.context import ServedModel
from service.engine import Engine
from service.idle import IdleJob
from service.limits import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from evospec.assembly import Stack
    from evospec.decoding.methods import Decoder

KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this many seconds


@dataclass
class Built:
    app: FastAPI
    engine: Engine
    model: ServedModel
    keeper: persistence.StateKeeper | None = None  # restart snapshots; None: nothing kept


def build(config: ServeConfig, *, progress: bool = True, log: TextIO = sys.stderr) -> Built:
    """Load everything ``config`` names (``assembly.assemble``); errors (bad paths, shapes, stale
    indices) surface as ValueError / CheckpointError / IndexLoadError. ``log`` gets one line per
    loaded part."""
    from evospec.assembly import assemble
    from service.app import create_app

    stacks = []

    def prepare():  # on the engine thread: it loads, tunes and then runs the model
        stacks.append(assemble(config.stack_settings(), progress=progress, defer_tuning=True))
        return stacks[0].decoder(config.method)

    engine = Engine(
        max_queue=config.max_queue, max_batch=config.max_batch, prefill_chunk=config.prefill_chunk
    )
    engine.start(prepare)
    stack = stacks[0]
    for line in stack.facts:
        print(f"[evospec] {line}", file=log)
    if stack.deferred is not None:
        engine.run_when_idle(tuning_job(stack, log))
    print(f"[evospec] {batching_fact(engine, config.max_batch)}", file=log)
    served = ServedModel(
        name=config.served_model_name or stack.loaded.name,
        codec=stack.codec,
        context_window=stack.loaded.model.cfg.max_position_embeddings,
        vocab_size=stack.loaded.model.cfg.vocab_size,
        eos_ids=stack.eos_ids,
    )
    served.prepare_json()
    app = create_app(engine, served, config)
    keeper = persistence.keeper_for(config, engine, served.name, stack.loaded.model, stack.draft)
    persistence.attach(app, keeper)
    return Built(app, engine, served, keeper)


def tuning_job(stack: Stack, log: TextIO) -> IdleJob:
    """The timings ``--method auto`` or ``--tree auto`` still needs, as the engine's idle work:
    the server answers with the provisional decoder meanwhile, and with the chosen one (cached
    for later starts) after."""
    deferred = stack.deferred

    def done(choice) -> Decoder:
        decoder = deferred.finish(stack, choice)
        print(f"[evospec] {stack.facts[-1]}; now serving {decoder.name}", file=log, flush=True)
        return decoder

    return IdleJob(f"{deferred.label}: timing {deferred.timing}", deferred.steps(), done)


def batching_fact(engine: Engine, max_batch: int | str) -> str:
    """The start-up line that says how concurrent requests are served (``max_batch``: as
    configured; the engine's snapshot has what it resolved to)."""
    if engine.batching:
        size = engine.snapshot().max_batch
        how = " (--max-batch auto: one pass of the int4 kernel over a weight)" if max_batch == "auto" else ""
        return (
            f"concurrent requests: up to {size} generated together once several wait{how} "
            "(plain decoding, one token each per step; a lone request runs its method)"
        )
    why = "--max-batch 1" if max_batch == 1 else "this model cannot step several sequences in one forward"
    return f"concurrent requests: one at a time ({why})"


def curl_example(host: str, port: int, model: ServedModel) -> str:
    """A command that works against this server as started (wildcard hosts become 127.0.0.1)."""
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in host:
        host = f"[{host}]"
    body: dict[str, object] = {"model": model.name, "max_tokens": 64, "temperature": 0}
    if model.codec.has_chat_template:
        route = "chat/completions"
        body["messages"] = [{"role": "user", "content": "Explain speculative decoding in one sentence."}]
    else:
        route = "completions"
        body["prompt"] = "Speculative decoding is"
    data = shlex.quote(json.dumps(body))
    return f"curl -s http://{host}:{port}/v1/{route} -H 'Content-Type: application/json' -d {data}"


def serve(config: ServeConfig, *, progress: bool = True, log: TextIO = sys.stderr) -> None:
    """Build, print the curl line, run uvicorn until interrupted. Uvicorn bounds idle keep-alive
    connections and a request head still arriving in pieces; the app's ``BodyLimits`` middleware
    bounds a whole head (431) and adds the timeout for a body that stops arriving
    (``body_read_timeout``), which uvicorn has not."""
    import uvicorn

    from evospec.common import stop_cleanly_on_sigterm

    built = build(config, progress=progress, log=log)
    if built.keeper is not None:
        print(f"[evospec] {built.keeper.restore()}", file=log)
        built.keeper.start()
    print(f"[evospec] serving {built.model.name} with method={built.engine.method}; try:", file=log)
    print(curl_example(config.host, config.port, built.model), file=log, flush=True)
    stop_cleanly_on_sigterm()  # `kill`, `docker stop`, systemd: the state below is still saved
    try:
        uvicorn.run(
            built.app,
            host=config.host,
            port=config.port,
            log_level="info",
            timeout_graceful_shutdown=5,
            timeout_keep_alive=KEEP_ALIVE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    finally:
        if built.keeper is not None:  # the lifespan has stopped the engine: the final state
            saved = "saved to" if built.keeper.close() else "NOT saved (see the log) to"
            print(f"[evospec] restart state {saved} {built.keeper.path}", file=log)

"""``evospec serve``: load the model named by a :class:`ServeConfig`, build the app, run uvicorn.

Owns: turning a config into a running server -- the decoder stack (``evospec/assembly.py``:
model, tokenizer, draft head, indices, decoder), the :class:`Engine`, the app -- a line per
loaded part and the ready-to-paste curl line, printed to stderr just before uvicorn starts.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from typing import TextIO

from fastapi import FastAPI

from service.config import ServeConfig
from service.context import ServedModel
from service.engine import Engine


@dataclass
class Built:
    app: FastAPI
    engine: Engine
    model: ServedModel


def build(config: ServeConfig, *, progress: bool = True, log: TextIO = sys.stderr) -> Built:
    """Load everything ``config`` names (``assembly.assemble``); errors (bad paths, shapes, stale
    indices) surface as ValueError / CheckpointError / IndexLoadError. ``log`` gets one line per
    loaded part."""
    from evospec.assembly import assemble
    from service.app import create_app

    stack = assemble(config.stack_settings(), progress=progress)
    for line in stack.facts:
        print(f"[evospec] {line}", file=log)
    served = ServedModel(
        name=config.served_model_name or stack.loaded.name,
        codec=stack.codec,
        context_window=stack.loaded.model.cfg.max_position_embeddings,
        vocab_size=stack.loaded.model.cfg.vocab_size,
    )
    engine = Engine(stack.decoder(config.method), max_queue=config.max_queue)
    return Built(create_app(engine, served, config), engine, served)


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
    import uvicorn

    built = build(config, progress=progress, log=log)
    print(f"[evospec] serving {built.model.name} with method={built.engine.method}; try:", file=log)
    print(curl_example(config.host, config.port, built.model), file=log, flush=True)
    uvicorn.run(built.app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)

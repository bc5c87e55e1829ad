"""``evospec serve``: load the model named by a :class:`ServeConfig`, build the app, run uvicorn.

Owns: turning a config into a running server -- model and tokenizer (``load_model``), the
draft head (``load_eagle``) and tree, the decoder (``make_decoder``), the :class:`Engine`, the
app -- and the ready-to-paste curl line printed to stderr just before uvicorn starts.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
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


def build(config: ServeConfig, *, progress: bool = True) -> Built:
    """Load everything ``config`` names; errors (bad paths, shapes) surface as ValueError/CheckpointError."""
    import torch

    from evospec.decoding.methods import make_decoder
    from evospec.decoding.tree import TreeConfig
    from evospec.models.loading import load_model
    from service.app import create_app

    dtype = getattr(torch, config.dtype)
    device = resolve_device(config.device)
    loaded = load_model(config.model, dtype=dtype, device=device, progress=progress)
    if loaded.codec is None:
        raise ValueError(f"{loaded.source} has no tokenizer.json; the server needs one to handle text")
    draft = None
    if config.method != "ar":
        from evospec.models.eagle import load_eagle
        from evospec.models.registry import default_head

        path = Path(config.draft).expanduser() if config.draft else default_head(loaded.name)
        if path is None:
            raise ValueError(f"method {config.method} needs draft: no head ships for {loaded.name}")
        draft = load_eagle(path, dtype=dtype, device=device)
    t = config.tree
    decoder = make_decoder(
        config.method,
        loaded.model,
        eos_ids=loaded.codec.eos_ids or loaded.model.cfg.eos_token_ids,
        draft=draft,
        tree=TreeConfig(top_k=t.top_k, depth=t.depth, total_tokens=t.total_tokens),
    )
    served = ServedModel(
        name=config.served_model_name or loaded.name,
        codec=loaded.codec,
        context_window=loaded.model.cfg.max_position_embeddings,
        vocab_size=loaded.model.cfg.vocab_size,
    )
    engine = Engine(decoder, max_queue=config.max_queue)
    return Built(create_app(engine, served, config), engine, served)


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; anything else unchanged."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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

    built = build(config, progress=progress)
    print(f"[evospec] serving {built.model.name} with method={config.method}; try:", file=log)
    print(curl_example(config.host, config.port, built.model), file=log, flush=True)
    uvicorn.run(built.app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)

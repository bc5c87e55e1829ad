"""``evospec serve``: load the model named by a :class:`ServeConfig`, build the app, run uvicorn.

Owns: turning a config into a running server -- model and tokenizer (``load_model``), the
draft head (``load_eagle``) and tree, the model's indices when the vocabulary policy reads
them (``indices.default.ensure_indices``: loaded, or built on first use), the decoder
(``make_decoder``), the :class:`Engine`, the app -- a line per loaded part and the
ready-to-paste curl line, printed to stderr just before uvicorn starts.
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
from service.engine import Engine, active_vocab_of


@dataclass
class Built:
    app: FastAPI
    engine: Engine
    model: ServedModel


def build(config: ServeConfig, *, progress: bool = True, log: TextIO = sys.stderr) -> Built:
    """Load everything ``config`` names; errors (bad paths, shapes, stale indices) surface as
    ValueError / CheckpointError / IndexLoadError. ``log`` gets one line per loaded part."""
    import torch

    from evospec.decoding.methods import ADAPTIVE, make_decoder
    from evospec.decoding.tree import TreeConfig
    from evospec.models.loading import load_model, resolve_device
    from evospec.vocab.factory import NEEDS_COUNTS, NEEDS_RETRIEVAL
    from service.app import create_app

    dtype = getattr(torch, config.dtype)
    device = resolve_device(config.device)
    loaded = load_model(config.model, dtype=dtype, device=device, progress=progress, pack=config.pack_weights)
    if loaded.codec is None:
        raise ValueError(f"{loaded.source} has no tokenizer.json; the server needs one to handle text")
    print(f"[evospec] model: {loaded.name} from {loaded.source} ({config.dtype} on {device})", file=log)
    draft = None
    if config.method != "ar":
        from evospec.models.eagle import load_eagle
        from evospec.models.registry import default_head

        path = Path(config.draft).expanduser() if config.draft else default_head(loaded.name)
        if path is None:
            raise ValueError(f"method {config.method} needs draft: no head ships for {loaded.name}")
        draft = load_eagle(path, dtype=dtype, device=device)
        print(f"[evospec] draft head: {path}", file=log)
    indices = None
    policy = ADAPTIVE[config.method][0] if config.method in ADAPTIVE else config.method
    if policy in NEEDS_COUNTS or policy in NEEDS_RETRIEVAL:
        from indices.default import ensure_indices

        folder = config.vocab.indices
        indices = ensure_indices(
            loaded,
            directory=Path(folder).expanduser() if folder else None,
            need_hnsw=policy in NEEDS_RETRIEVAL,
            progress=progress,
        )
        print(f"[evospec] indices: {describe_indices(indices)}", file=log)
    t = config.tree
    decoder = make_decoder(
        config.method,
        loaded.model,
        eos_ids=loaded.codec.eos_ids or loaded.model.cfg.eos_token_ids,
        draft=draft,
        tree=TreeConfig(top_k=t.top_k, depth=t.depth, total_tokens=t.total_tokens),
        vocab=config.vocab.to_vocab_config(),
        indices=indices,
        adapt=config.adapt.to_adapt_config(ADAPTIVE[config.method][1]) if config.method in ADAPTIVE else None,
        verify_logits=config.verify_logits,
    )
    vocab = active_vocab_of(decoder)
    if vocab is not None:
        print(f"[evospec] draft vocabulary: {describe_vocab(vocab.state())}", file=log)
    served = ServedModel(
        name=config.served_model_name or loaded.name,
        codec=loaded.codec,
        context_window=loaded.model.cfg.max_position_embeddings,
        vocab_size=loaded.model.cfg.vocab_size,
    )
    if config.method in ADAPTIVE:
        a = config.adapt
        print(
            f"[evospec] online adaptation: {ADAPTIVE[config.method][1]} lr={a.lr:g} buffer={a.buffer_size} "
            f"scope={a.scope}",
            file=log,
        )
    engine = Engine(decoder, max_queue=config.max_queue)
    return Built(create_app(engine, served, config), engine, served)


def describe_indices(bundle) -> str:
    """One line about an ``indices.IndexBundle``: where it is, what it holds, what it counted."""
    m = bundle.manifest
    parts = [f"frequency table ({m.corpus.num_tokens:,} tokens of {m.corpus.description})"]
    parts.append(f"bigram graph ({m.num_edges:,} edges)")
    if bundle.hnsw is not None:
        parts.append("HNSW over the LM head")
    return f"{bundle.directory}: " + ", ".join(parts) + f"; built {m.created}"


def describe_vocab(state: dict) -> str:
    """One line from ``ActiveVocab.state()``: policy and sizes."""
    keys = ("capacity", "static_size", "window", "arc_size")
    sizes = " ".join(f"{k}={state[k]}" for k in keys if state.get(k) is not None)
    if "arc" in state:
        sizes += f" arc_capacity={state['arc']['config']['capacity']}"
    return f"policy={state['policy']} {sizes}"


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
    print(f"[evospec] serving {built.model.name} with method={config.method}; try:", file=log)
    print(curl_example(config.host, config.port, built.model), file=log, flush=True)
    uvicorn.run(built.app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)

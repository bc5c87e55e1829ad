"""What every route needs, passed explicitly: the engine, the served model's text edge, the config.

Owns: :class:`ServedModel` (the name clients send, the tokenizer, the context window) and
:class:`ServiceContext` (engine + served model + config + metrics + admin token), built once
by ``app.create_app`` and captured by the routers. No globals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from evospec.tokenizer import TextCodec
from service.config import ServeConfig
from service.engine import Engine
from service.metrics import ServiceMetrics


@dataclass(frozen=True)
class ServedModel:
    name: str  # the "model" value clients send and /v1/models lists
    codec: TextCodec  # tokenizer + chat template of the target
    context_window: int  # prompt + completion tokens the target accepts
    vocab_size: int  # token ids a token-id prompt may use: 0 .. vocab_size - 1
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True)
class ServiceContext:
    engine: Engine
    model: ServedModel
    config: ServeConfig
    metrics: ServiceMetrics
    admin_token: str | None  # None: the admin API is disabled

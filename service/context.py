"""What every route needs, passed explicitly: the engine, the served model's text edge, the config.

Owns: :class:`ServedModel` (the name clients send, the tokenizer, the context window, JSON
mode's token table) and
:class:`ServiceContext` (engine + served model + config + metrics + admin token), built once
by ``app.create_app`` and captured by the routers. No globals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property

from evospec.decoding.json_grammar import JsonGrammar
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
    eos_ids: tuple[int, ...] = ()  # the tokens that end a text (empty: the tokenizer's)

    @cached_property
    def json_grammar(self) -> JsonGrammar:
        """JSON mode's token table (built on the first JSON request: ~0.6 s for 49k tokens)."""
        return JsonGrammar.for_codec(self.codec, self.eos_ids or self.codec.eos_ids, self.vocab_size)


@dataclass(frozen=True)
class ServiceContext:
    engine: Engine
    model: ServedModel
    config: ServeConfig
    metrics: ServiceMetrics
    admin_token: str | None  # None: the admin API is disabled

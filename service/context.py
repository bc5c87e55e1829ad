"""What every route needs, passed explicitly: the engine, the served model's text edge, the config.

Owns: :class:`ServedModel` (the name clients send, the tokenizer, the context window, the JSON
grammars of JSON mode and recent schemas) and
:class:`ServiceContext` (engine + served model + config + metrics + admin token), built once
by ``app.create_app`` and captured by the routers. No globals.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property

from evospec.decoding.json_grammar import JsonGrammar, TokenTable
from evospec.decoding.json_schema import OBJECT, Schema
from evospec.tokenizer import TextCodec
from service.config import ServeConfig
from service.engine import Engine
from service.metrics import ServiceMetrics

KEPT_GRAMMARS = (
    8  # JSON grammars (JSON mode's and recent schemas') kept with their masks (16 MB each at most)
)


@dataclass(frozen=True)
class ServedModel:
    name: str  # the "model" value clients send and /v1/models lists
    codec: TextCodec  # tokenizer + chat template of the target
    context_window: int  # prompt + completion tokens the target accepts
    vocab_size: int  # token ids a token-id prompt may use: 0 .. vocab_size - 1
    created: int = field(default_factory=lambda: int(time.time()))
    eos_ids: tuple[int, ...] = ()  # the tokens that end a text (empty: the tokenizer's)

    grammars: OrderedDict[str, JsonGrammar] = field(default_factory=OrderedDict, repr=False, compare=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @cached_property
    def json_tokens(self) -> TokenTable:
        """The tokens as bytes, for JSON grammars (built on the first JSON request: ~0.9 s for 49k tokens)."""
        return TokenTable.for_codec(self.codec, self.eos_ids or self.codec.eos_ids, self.vocab_size)

    def prepare_json(self) -> threading.Thread:
        """Start building JSON mode's token table now, beside the first requests, not in the
        first JSON one. Not a daemon thread: a process that exits meanwhile waits for it (~1 s);
        a daemon still inside torch when the interpreter exits would abort it."""
        thread = threading.Thread(target=self.json_grammar, name="evospec-json-tokens")
        thread.start()
        return thread

    def json_grammar(self, key: str = "", schema: Schema = OBJECT) -> JsonGrammar:
        """The grammar of ``schema`` (``key``: its canonical text; "": JSON mode), shared by the
        requests that send it so that its masks are computed once: the last
        :data:`KEPT_GRAMMARS` are kept."""
        with self.lock:
            grammar = self.grammars.pop(key, None) or JsonGrammar(self.json_tokens, schema)
            self.grammars[key] = grammar
            while len(self.grammars) > KEPT_GRAMMARS:
                self.grammars.popitem(last=False)
            return grammar


@dataclass(frozen=True)
class ServiceContext:
    engine: Engine
    model: ServedModel
    config: ServeConfig
    metrics: ServiceMetrics
    admin_token: str | None  # None: the admin API is disabled

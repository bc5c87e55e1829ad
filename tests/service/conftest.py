"""Service fixtures: a tiny random target that speaks the default model's tokenizer, served live.

The target is a 2-layer, hidden-32 llama whose vocabulary is the real SmolLM2 tokenizer's
(49,152 ids), so text goes through the real codec and chat template while a forward costs well
under a millisecond. The servers, instrumented decoders and response checks these fixtures
use are in ``helpers.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from evospec.decoding.methods import Decoder, make_decoder
from evospec.models.eagle import EagleHead, new_eagle_for
from evospec.models.transformer import Transformer
from evospec.tokenizer import TextCodec
from tests.decoding.spec_helpers import tiny_target
from tests.service.helpers import CONTEXT, LiveServer, ar_ids, start_server


@pytest.fixture(scope="session")
def codec() -> TextCodec:
    from evospec.models.registry import DEFAULT_MODEL, REGISTRY, ensure_converted

    return TextCodec.from_folder(ensure_converted(REGISTRY[DEFAULT_MODEL], progress=False))


@pytest.fixture(scope="session")
def tiny(codec: TextCodec) -> Transformer:
    """A 2-layer random llama over the real tokenizer's vocabulary (peaked distributions)."""
    return tiny_target(0, ctx=CONTEXT, vocab=codec.vocab_size, eos=codec.eos_ids)


@pytest.fixture(scope="session")
def reference(tiny: Transformer, codec: TextCodec) -> Callable[[list[int], int], str]:
    return lambda ids, n: codec.decode(ar_ids(tiny, codec, ids, n))


@pytest.fixture(scope="module")
def head(tiny: Transformer) -> EagleHead:
    """A random EAGLE head for ``tiny``, shared by a module's speculative decoders."""
    return new_eagle_for(tiny, seed=3)


# -- live servers -----------------------------------------------------------------------------------
@pytest.fixture
def serve(codec: TextCodec, tiny: Transformer) -> Iterator[Callable[..., LiveServer]]:
    """Factory: ``serve(decoder=None, **config)`` starts a server, stopped after the test."""
    started: list[LiveServer] = []

    def factory(decoder: Decoder | None = None, **kw: Any) -> LiveServer:
        live = start_server(decoder or make_decoder("ar", tiny, eos_ids=codec.eos_ids), codec, tiny, **kw)
        started.append(live)
        return live

    yield factory
    for live in started:
        live.stop()


@pytest.fixture(scope="session")
def ar_server(codec: TextCodec, tiny: Transformer) -> Iterator[LiveServer]:
    """The shared plain-decoding server most API tests talk to."""
    live = start_server(make_decoder("ar", tiny, eos_ids=codec.eos_ids), codec, tiny)
    yield live
    live.stop()

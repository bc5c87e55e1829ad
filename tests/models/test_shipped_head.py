"""The EAGLE-2 head shipped for the default model: loads, fits the model, and is lossless."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import load_eagle
from evospec.models.loading import LoadedModel
from evospec.models.registry import DEFAULT_MODEL, default_head


def test_head_ships_small_and_in_the_eagle_layout() -> None:
    folder = default_head(DEFAULT_MODEL)
    assert folder is not None
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    head = load_eagle(folder)
    assert head.embed_tokens is None  # shares the target's embedding
    assert set(head.state_dict()) >= {"fc.weight", "layers.0.self_attn.q_proj.weight"}


@pytest.mark.parametrize("tree", [TreeConfig(4, 4, 16), TreeConfig()], ids=["small", "eagle2-default"])
def test_eagle2_with_shipped_head_equals_ar(default_model: LoadedModel, tree: TreeConfig) -> None:
    model, codec = default_model.model, default_model.codec
    ids = codec.encode_chat([{"role": "user", "content": "List three primary colors."}])
    params = SamplingParams(max_new_tokens=24)
    eos = codec.eos_ids
    ar = [t for ev in make_decoder("ar", model, eos_ids=eos).generate(ids, params) for t in ev.tokens]
    draft = load_eagle(default_head(DEFAULT_MODEL))
    events = list(make_decoder("eagle2", model, eos_ids=eos, draft=draft, tree=tree).generate(ids, params))
    assert [t for ev in events for t in ev.tokens] == ar
    rounds = [ev for ev in events if not ev.prefill]
    assert sum(ev.accepted for ev in rounds) > 0  # a trained head gets drafts accepted


def test_eagle3_head_ships_small_tied_and_in_the_public_layout() -> None:
    import json

    from evospec.models.eagle3 import ARCHITECTURE, load_eagle3

    folder = default_head(DEFAULT_MODEL, arch="eagle3")
    assert folder is not None and (folder / "training.json").is_file()
    assert (folder / "model.safetensors").stat().st_size <= 25 * 2**20
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == [ARCHITECTURE] and raw["tie_word_embeddings"] is True
    head = load_eagle3(folder)
    assert head.tied and head.aux_layers == (1, 14, 26) and head.draft_ids() is None
    assert "lm_head.weight" not in head.state_dict() and "midlayer.hidden_norm.weight" in head.state_dict()


def test_eagle3_with_shipped_head_equals_ar(default_model: LoadedModel) -> None:
    from evospec.models.eagle3 import load_eagle3

    model, codec = default_model.model, default_model.codec
    ids = codec.encode_chat([{"role": "user", "content": "List three primary colors."}])
    params = SamplingParams(max_new_tokens=24)
    eos = codec.eos_ids
    ar = [t for ev in make_decoder("ar", model, eos_ids=eos).generate(ids, params) for t in ev.tokens]
    draft = load_eagle3(default_head(DEFAULT_MODEL, arch="eagle3"), target_layers=model.cfg.num_layers)
    dec = make_decoder("eagle3", model, eos_ids=eos, draft=draft, tree=TreeConfig(4, 4, 16))
    events = list(dec.generate(ids, params))
    assert [t for ev in events for t in ev.tokens] == ar
    assert sum(ev.accepted for ev in events if not ev.prefill) > 0


def test_the_shipped_ngram_table_fits_the_model_and_ngram_with_it_equals_ar(
    default_model: LoadedModel,
) -> None:
    """The default model's n-gram table loads against its vocabulary, proposes in many rounds of
    a real answer, gets guesses accepted, and the output is still plain decoding's."""
    from evospec.decoding.ngram_table import load_ngram_table
    from evospec.models.registry import default_ngrams

    path = default_ngrams(DEFAULT_MODEL)
    assert path is not None and path.stat().st_size <= 8 * 2**20
    model, codec = default_model.model, default_model.codec
    table = load_ngram_table(path, vocab_size=model.cfg.vocab_size)
    assert table.info.model == DEFAULT_MODEL and len(table) > 100_000
    ids = codec.encode_chat([{"role": "user", "content": "Explain step by step how to boil an egg."}])
    params = SamplingParams(max_new_tokens=32)
    eos = codec.eos_ids
    ar = [t for ev in make_decoder("ar", model, eos_ids=eos).generate(ids, params) for t in ev.tokens]
    events = list(make_decoder("ngram", model, eos_ids=eos, ngrams=table).generate(ids, params))
    assert [t for ev in events for t in ev.tokens] == ar
    rounds = [ev for ev in events if not ev.prefill]
    assert sum(ev.tree_size > 0 for ev in rounds) > len(rounds) / 3 and sum(ev.accepted for ev in rounds) > 0
    alone = list(make_decoder("ngram", model, eos_ids=eos).generate(ids, params))  # context lookup only
    assert sum(ev.accepted for ev in alone) < sum(ev.accepted for ev in events)

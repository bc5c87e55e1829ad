"""Every vocabulary method on the default model, its shipped head and its real indices: greedy
output equals AR, the reduced vocabularies really are reduced, and retrieval really runs."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import load_eagle
from evospec.models.loading import LoadedModel
from evospec.models.registry import DEFAULT_MODEL, default_head
from evospec.vocab.factory import NEEDS_FILES, POLICIES, VocabConfig

PROMPTS = ["Write a haiku about the ocean.", "What is the capital of Australia? Explain briefly."]


@pytest.mark.slow
def test_every_policy_on_the_default_model_equals_ar(default_model: LoadedModel) -> None:
    from indices.default import ensure_indices  # builds on first use (~2 minutes on 2 cores)

    model, codec = default_model.model, default_model.codec
    needed = sorted({f for files in NEEDS_FILES.values() for f in files})  # the shipped ones
    indices = ensure_indices(default_model, need_files=needed, progress=False)
    draft = load_eagle(default_head(DEFAULT_MODEL))
    params = SamplingParams(max_new_tokens=32)
    prompts = [codec.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    ar = make_decoder("ar", model, eos_ids=codec.eos_ids)
    expected = [[t for ev in ar.generate(ids, params) for t in ev.tokens] for ids in prompts]
    cfg = VocabConfig(synchronous=True)  # deterministic ARC contents
    for name in POLICIES:
        dec = make_decoder(
            name,
            model,
            eos_ids=codec.eos_ids,
            draft=draft,
            tree=TreeConfig(4, 4, 16),
            vocab=cfg,
            indices=indices,
        )
        rounds = []
        for ids, want in zip(prompts, expected, strict=True):
            events = list(dec.generate(ids, params))
            assert [t for ev in events for t in ev.tokens] == want, name
            rounds += [ev.vocab for ev in events if not ev.prefill]
        assert max(r.active_size for r in rounds) < model.cfg.vocab_size // 3, name
        assert sum(r.covered for r in rounds) > 0.5 * sum(r.verified for r in rounds), name
        if name in ("evospec", "nanospec+evospec"):
            assert sum(len(r.retrieval_s) for r in rounds) > 0, name  # OOV events were retrieved
        dec.vocab.close()

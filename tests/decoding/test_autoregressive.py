"""Plain autoregressive decoding: stop conditions, context budget, decoder reuse, parity with HF."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.budget import plan_budget, stop_rule
from evospec.decoding.events import StepEvent
from evospec.decoding.methods import METHODS, ARDecoder, make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.models.loading import LoadedModel
from evospec.models.transformer import Transformer
from tests.conftest import FAMILIES, TinyPair, hf_logits, random_tokens, tiny_models

CTX = 48  # max_position_embeddings of the tiny_llama fixture


def _prompt(n: int, seed: int = 0) -> list[int]:
    return random_tokens(n, seed=seed)[0].tolist()


def _run(
    model: Transformer, prompt: Sequence[int], params: SamplingParams, **kw
) -> tuple[list[int], list[StepEvent]]:
    events = list(generate_ar(model, prompt, params, **kw))
    return [t for ev in events for t in ev.tokens], events


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _first_new_token_index(tokens: list[int], start: int) -> int:
    """An index >= start whose token does not occur earlier (so stopping on it is unambiguous)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_reference_argmax(family: str) -> None:
    """Token by token equal to argmax over a full transformers forward (gemma3: past its window)."""
    pair = tiny_models(family, seed=51)
    prompt = _prompt(6, seed=52)
    tokens, _ = _run(pair.ours, prompt, _greedy(12))
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(hf_logits(pair.hf, torch.tensor([seq]))[0, -1].argmax()))
    assert tokens == seq[len(prompt) :]


def test_length_budget_one_event_per_token(tiny_llama: TinyPair) -> None:
    tokens, events = _run(tiny_llama.ours, _prompt(5), _greedy(7))
    assert len(tokens) == 7 and len(events) == 7
    assert all(len(ev.tokens) == 1 and ev.accepted == 0 and ev.verify_s > 0 for ev in events)
    assert [ev.finish_reason for ev in events] == [None] * 6 + ["length"]
    assert [ev.prefill for ev in events] == [True] + [False] * 6  # the prompt forward's token


def test_stops_on_eos_and_keeps_it(tiny_llama: TinyPair) -> None:
    prompt = _prompt(5, seed=1)
    ref, _ = _run(tiny_llama.ours, prompt, _greedy(20))
    k = _first_new_token_index(ref, 3)
    tokens, events = _run(tiny_llama.ours, prompt, SamplingParams(max_new_tokens=20), eos_ids=(ref[k],))
    assert tokens == ref[: k + 1]
    assert events[-1].finish_reason == "stop"
    ignored, _ = _run(tiny_llama.ours, prompt, _greedy(20), eos_ids=(ref[k],))
    assert ignored == ref


def test_stops_on_stop_ids_even_with_ignore_eos(tiny_llama: TinyPair) -> None:
    prompt = _prompt(5, seed=2)
    ref, _ = _run(tiny_llama.ours, prompt, _greedy(20))
    k = _first_new_token_index(ref, 2)
    params = SamplingParams(max_new_tokens=20, stop_ids=frozenset({ref[k]}), ignore_eos=True)
    tokens, events = _run(tiny_llama.ours, prompt, params)
    assert tokens == ref[: k + 1] and events[-1].finish_reason == "stop"


def test_stop_rule_eos_sources(tiny_llama: TinyPair) -> None:
    model = tiny_llama.ours
    assert model.cfg.eos_token_ids == (2,)
    params = SamplingParams(stop_ids=frozenset({7}))
    assert stop_rule(model, params, 5).stop_ids == {2, 7}  # the model's EOS by default
    assert stop_rule(model, params, 5, eos_ids=(3,)).stop_ids == {3, 7}  # explicit EOS replaces it
    ignore = SamplingParams(stop_ids=frozenset({7}), ignore_eos=True)
    assert stop_rule(model, ignore, 5, eos_ids=(3,)).stop_ids == {7}


@pytest.mark.parametrize("prompt_len", [CTX, CTX + 1])
def test_prompt_at_or_over_context_raises(tiny_llama: TinyPair, prompt_len: int) -> None:
    with pytest.raises(ValueError, match="context window"):
        list(generate_ar(tiny_llama.ours, [1] * prompt_len, _greedy(4)))
    with pytest.raises(ValueError, match="context window"):
        ARDecoder(tiny_llama.ours).generate([1] * prompt_len, _greedy(4))


def test_empty_prompt_raises(tiny_llama: TinyPair) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        list(generate_ar(tiny_llama.ours, [], _greedy(4)))


def test_prompt_near_context_clips_max_new_tokens(tiny_llama: TinyPair) -> None:
    prompt = _prompt(CTX - 3, seed=3)
    b = plan_budget(tiny_llama.ours, len(prompt), _greedy(10))
    assert (b.max_new, b.slots, b.rule.max_new_tokens) == (3, CTX, 3)
    assert plan_budget(tiny_llama.ours, len(prompt), _greedy(10), slack=4).slots == CTX + 4
    tokens, events = _run(tiny_llama.ours, prompt, _greedy(10))
    assert len(tokens) == 3 and events[-1].finish_reason == "length"
    assert tokens == _run(tiny_llama.ours, prompt, _greedy(3))[0]
    one, _ = _run(tiny_llama.ours, _prompt(CTX - 1, seed=3), _greedy(10))
    assert len(one) == 1


def test_small_cache_argument_is_replaced(tiny_llama: TinyPair) -> None:
    prompt = _prompt(6, seed=4)
    small = tiny_llama.ours.new_cache(4)
    assert (
        _run(tiny_llama.ours, prompt, _greedy(5), cache=small)[0]
        == _run(tiny_llama.ours, prompt, _greedy(5))[0]
    )


def test_ar_decoder_reuse_equals_fresh(tiny_llama: TinyPair) -> None:
    model = tiny_llama.ours
    requests = [
        (_prompt(4, 5), _greedy(3)),
        (_prompt(20, 6), _greedy(12)),
        (_prompt(7, 7), _greedy(9)),
        (_prompt(4, 5), _greedy(3)),
    ]
    reused = ARDecoder(model)
    sizes = []
    for prompt, params in requests:
        got = [t for ev in reused.generate(prompt, params) for t in ev.tokens]
        sizes.append(reused.cache.max_len)
        fresh = [t for ev in ARDecoder(model).generate(prompt, params) for t in ev.tokens]
        assert got == fresh
    assert sizes[1] > sizes[0] and sizes[2] == sizes[1]  # grown once, then reused


def test_seeded_sampling_is_reproducible(tiny_llama: TinyPair) -> None:
    prompt = _prompt(5, seed=8)

    def sample(seed: int) -> list[int]:
        return _run(
            tiny_llama.ours,
            prompt,
            SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, ignore_eos=True),
        )[0]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_make_decoder() -> None:
    model = tiny_models("qwen2", seed=53).ours
    assert "ar" in METHODS
    dec = make_decoder("ar", model, eos_ids=(5,))
    assert isinstance(dec, ARDecoder) and dec.name == "ar" and dec.eos_ids == (5,)
    with pytest.raises(ValueError, match="unknown method 'no-such-method'; available: ar") as info:
        make_decoder("no-such-method", model)
    assert all(m in str(info.value) for m in METHODS) and "or auto" in str(info.value)


# -- the real default model vs transformers' generate ------------------------------------------------------
def _hf_greedy(hf, prompt: list[int], n: int, eos: Sequence[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    return out[0, len(prompt) :].tolist()


def test_default_model_greedy_matches_transformers(default_model: LoadedModel, hf_default) -> None:
    codec = default_model.codec
    prompt = codec.encode_chat([{"role": "user", "content": "Name three primary colours."}])
    ours = [
        t
        for ev in ARDecoder(default_model.model, codec.eos_ids).generate(prompt, SamplingParams(16))
        for t in ev.tokens
    ]
    assert len(ours) == 16
    assert ours == _hf_greedy(hf_default, prompt, 16, codec.eos_ids)


SLOW_PROMPTS = [
    ("chat", "Explain what a hash table is in two sentences."),
    ("chat", "Write a short poem about autumn leaves."),
    ("chat", "What is 17 times 23? Show your work."),
    ("plain", "The history of the Roman Empire begins"),
    ("plain", "def quicksort(arr):\n"),
]


@pytest.mark.slow
def test_default_model_greedy_matches_hf_baseline_decoder(default_model: LoadedModel) -> None:
    from evospec.bench.hf_baseline import HFGenerateDecoder

    codec = default_model.codec
    hf = HFGenerateDecoder(default_model.source, codec.eos_ids)
    ours = ARDecoder(default_model.model, codec.eos_ids)
    params = SamplingParams(max_new_tokens=64)
    for kind, text in SLOW_PROMPTS:
        prompt = (
            codec.encode_chat([{"role": "user", "content": text}]) if kind == "chat" else codec.encode(text)
        )
        ours_events = list(ours.generate(prompt, params))
        hf_events = list(hf.generate(prompt, params))
        assert [t for ev in ours_events for t in ev.tokens] == [t for ev in hf_events for t in ev.tokens], (
            text
        )
        assert ours_events[-1].finish_reason == hf_events[-1].finish_reason

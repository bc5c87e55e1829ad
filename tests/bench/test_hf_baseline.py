"""The transformers baseline: same greedy tokens as ours, prefill timed apart from decoding."""

from __future__ import annotations

from pathlib import Path

from evospec.bench.hf_baseline import HFGenerateDecoder
from evospec.decoding.methods import ARDecoder
from evospec.decoding.sampling import SamplingParams
from tests.conftest import TinyPair, random_tokens


def test_events_tokens_and_prefill_time(tiny_llama: TinyPair, tmp_path: Path) -> None:
    tiny_llama.hf.save_pretrained(tmp_path)
    hf = HFGenerateDecoder(tmp_path, eos_ids=[])
    prompt = random_tokens(7, seed=4)[0].tolist()
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    events = list(hf.generate(prompt, params))
    ours = [t for ev in ARDecoder(tiny_llama.ours).generate(prompt, params) for t in ev.tokens]
    assert [t for ev in events for t in ev.tokens] == ours
    assert [ev.prefill for ev in events] == [True, False, False, False, False]
    assert all(ev.verify_s > 0 for ev in events)
    assert events[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in events[:-1])
    decode = {ev.verify_s for ev in events[1:]}
    assert len(decode) == 1  # the decode time is spread evenly; the prefill's is its own


def test_no_progress_hides_the_bar_transformers_draws_while_loading(
    tiny_llama: TinyPair, tmp_path: Path, monkeypatch
) -> None:
    from transformers.utils import logging as hf_logging

    tiny_llama.hf.save_pretrained(tmp_path)
    seen = []
    real = hf_logging.is_progress_bar_enabled
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(real())
        return load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    HFGenerateDecoder(tmp_path, eos_ids=[], progress=False)
    HFGenerateDecoder(tmp_path, eos_ids=[])
    assert seen == [False, True] and real()  # off while it loaded, then as it was

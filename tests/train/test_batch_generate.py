"""Continuous batched greedy generation equals plain greedy decoding row by row."""

from __future__ import annotations

import pytest

from evospec.decoding.sampling import SamplingParams
from evospec.train.batch_generate import greedy_batch, greedy_stream
from tests.decoding.spec_helpers import ar_tokens, prompt_of, tiny_target

EOS = (5,)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(0, ctx=512)
    prompts = [prompt_of(i, 3 + (7 * i) % 20) for i in range(23)]
    ref = [ar_tokens(target, p, SamplingParams(max_new_tokens=15), eos=EOS) for p in prompts]
    assert any(r[-1] == 5 for r in ref) and any(len(r) == 15 for r in ref)  # both stop kinds occur
    return target, prompts, ref


@pytest.mark.parametrize(
    "batch,cache_len,refill",
    [(4, 64, 1), (8, 40, 2), (3, 512, 3), (30, 100, None)],
    ids=["refill-each", "small-cache-many-waves", "long-cache", "batch>prompts"],
)
def test_rows_equal_plain_greedy(setup, batch, cache_len, refill):
    target, prompts, ref = setup
    out = greedy_batch(target, prompts, 15, EOS, batch_size=batch, cache_len=cache_len, refill_at=refill)
    assert out == ref


@pytest.mark.parametrize("batch,cache_len,refill", [(4, 64, 1), (8, 40, 2), (30, 100, None)])
def test_grouped_prefill_rows_equal_plain_greedy(setup, batch, cache_len, refill):
    """Refills prefilled in one left-padded forward (the GPU default) answer as plain decoding."""
    target, prompts, ref = setup
    kw = dict(batch_size=batch, cache_len=cache_len, refill_at=refill, grouped_prefill=True)
    assert greedy_batch(target, prompts, 15, EOS, **kw) == ref


def test_stream_yields_every_prompt_once(setup):
    target, prompts, _ = setup
    seen = [done.index for done in greedy_stream(target, prompts, 6, EOS, batch_size=5, cache_len=64)]
    assert sorted(seen) == list(range(len(prompts)))


def test_cache_too_small_is_an_error(setup):
    target, prompts, _ = setup
    with pytest.raises(ValueError, match="cache_len"):
        greedy_batch(target, prompts, 50, EOS, cache_len=40)


def test_pick_chooses_every_token(setup):
    """A caller's ``pick`` replaces the argmax at the prefill's first token and every step."""
    import torch

    target, prompts, _ = setup
    seen_rows: list[int] = []

    def second_best(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]
        seen_rows.append(logits.shape[0])
        return logits.topk(2, dim=-1).indices[:, 1]

    out = greedy_batch(target, prompts[:6], 8, (), batch_size=4, cache_len=64, pick=second_best)
    assert seen_rows and 1 in seen_rows and 4 in seen_rows  # prefill rows one by one, steps batched
    for p, answer in zip(prompts[:6], out, strict=True):
        ids = list(p)
        for tok in answer:  # each token is the runner-up of plain decoding's logits there
            logits = target(
                torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(64), logits="last"
            ).logits
            assert tok == int(logits[0, -1].topk(2).indices[1])
            ids.append(tok)

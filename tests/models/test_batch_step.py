"""Several sequences stepped in one forward: every row bitwise its own one-token step."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.batch_step import batched_steps_apply, step_sequences
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import prompt_of, tiny_target

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)


def _model(head_dim: int = 64, fmt: str = "int4"):
    model = tiny_target(4, head_dim=head_dim)
    quantize_linears(model, fmt)
    model.exact_rows = True
    assert enable_fused_ops(model)
    return model


def _prefilled(model, prompt: list[int], max_len: int):
    cache = model.new_cache(max_len)
    out = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, logits="last")
    return cache, int(out.logits[0, -1].argmax())


def _solo(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """Greedy one-token steps alone: tokens fed, each step's logits, and the cache's K at the end."""
    cache, tok = _prefilled(model, prompt, len(prompt) + steps + 4)
    fed, logits = [], []
    for _ in range(steps):
        out = model(torch.tensor([[tok]]), torch.tensor([cache.length]), cache, logits="last")
        fed.append(tok)
        logits.append(out.logits[0, -1].clone())
        tok = int(logits[-1].argmax())
    return fed, logits, cache.k[:, :, :, : cache.length].clone()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_stepped_together_are_bitwise_each_sequences_own_steps(threads):
    model = _model()
    if not batched_steps_apply(model):
        pytest.skip("batched steps need every linear on our int4 kernel (AVX2 or VNNI)")
    prompts = [prompt_of(1, 5), prompt_of(2, 37), prompt_of(3, 70), prompt_of(4, 12)]  # other lengths
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model.step_graph = StepGraph(model)  # alone: the recorded steps a decoder takes
        solo = [_solo(model, p, 9) for p in prompts]
        model.step_graph = None
        sizes = [len(p) + 12 + 5 * i for i, p in enumerate(prompts)]  # caches of other sizes than alone
        started = [_prefilled(model, p, size) for p, size in zip(prompts, sizes, strict=True)]
        caches, toks = [c for c, _ in started], [t for _, t in started]
        for step in range(9):
            # sequences join late and leave early, as requests do: rows 1.. only from step 2
            live = [i for i in range(4) if step < 7 or i != 3]
            live = [i for i in live if step >= 2 or i == 0]
            for i in range(4):
                if i not in live and step < 2:  # a sequence that has not joined steps alone
                    live_logits = model(
                        torch.tensor([[toks[i]]]), torch.tensor([caches[i].length]), caches[i], logits="last"
                    ).logits[0, -1]
                    assert torch.equal(live_logits, solo[i][1][step])
                    toks[i] = int(live_logits.argmax())
            rows = step_sequences(model, [toks[i] for i in live], [caches[i] for i in live])
            assert rows.shape == (len(live), model.cfg.vocab_size)
            for j, i in enumerate(live):
                assert toks[i] == solo[i][0][step]
                assert torch.equal(rows[j], solo[i][1][step]), (i, step)
                toks[i] = int(rows[j].argmax())
    finally:
        torch.set_num_threads(before)
    for i in range(3):  # sequences 0-2 took all 9 steps: the same K written at the same slots
        assert torch.equal(caches[i].k[:, :, :, : caches[i].length], solo[i][2])


def test_the_op_by_op_fallback_gives_the_same_rows(monkeypatch):
    model = _model()
    if not batched_steps_apply(model):
        pytest.skip("batched steps need every linear on our int4 kernel (AVX2 or VNNI)")
    prompts = [prompt_of(5, 9), prompt_of(6, 21)]

    def run():
        started = [_prefilled(model, p, 40) for p in prompts]
        return step_sequences(model, [t for _, t in started], [c for c, _ in started])

    team = run()
    monkeypatch.setenv("EVOSPEC_LAYER_TEAM", "0")
    assert torch.equal(team, run())


def test_bad_batches_are_refused():
    model = _model()
    if not batched_steps_apply(model):
        pytest.skip("batched steps need every linear on our int4 kernel (AVX2 or VNNI)")
    cache, tok = _prefilled(model, prompt_of(1, 4), 5)
    with pytest.raises(ValueError, match="twice"):
        step_sequences(model, [tok, tok], [cache, cache])
    with pytest.raises(ValueError, match="one cache per token"):
        step_sequences(model, [tok], [])
    step_sequences(model, [tok], [cache])  # the last free slot
    with pytest.raises(ValueError, match="cannot take a token"):
        step_sequences(model, [tok], [cache])


def test_which_models_step_sequences_together():
    assert not batched_steps_apply(tiny_target(0))  # fp32: not on the fused ops
    assert not batched_steps_apply(_model(fmt="int8"))  # fused, but its products are not our int4 kernel
    gemma = tiny_target(0, family="gemma3")
    quantize_linears(gemma, "int4")
    enable_fused_ops(gemma)
    assert not batched_steps_apply(gemma)

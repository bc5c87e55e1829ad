"""Plain decoding of several requests in one batch: each member's tokens are its own plain
decoding's, whoever joins or leaves around it."""

from __future__ import annotations

import pytest
import torch

from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.batch import DecodeBatch
from evospec.decoding.sampling import SamplingParams
from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.batch_step import batched_steps_apply
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import prompt_of, tiny_target

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)


@pytest.fixture(scope="module")
def model():
    m = tiny_target(11, head_dim=64)
    quantize_linears(m, "int4")
    m.exact_rows = True
    assert enable_fused_ops(m)
    if not batched_steps_apply(m):
        pytest.skip("batched steps need every linear on our int4 kernel (AVX2 or VNNI)")
    m.step_graph = StepGraph(m)
    return m


def _alone(model, prompt, params, eos=()) -> list[int]:
    return [t for ev in generate_ar(model, prompt, params, eos_ids=eos) for t in ev.tokens]


def _run(batch: DecodeBatch, arrivals: dict, out: dict | None = None) -> dict[str, list[int]]:
    """Members join at the steps ``arrivals`` names ({step: [(key, prompt, params)]}); returns
    every member's tokens (``out``: members handed over to the batch, and their tokens so far)."""
    out = {} if out is None else out
    handed = set(out)
    step = 0
    while len(batch) or any(s >= step for s in arrivals):
        for key, prompt, params in arrivals.get(step, []):
            batch.join(key, prompt, params)
            out[key] = []
        for key, ev in batch.advance():
            assert ev.prefill == (not out[key] and key not in handed)  # a member's first event
            out[key] += ev.tokens
        step += 1
    return out


def test_members_joining_and_leaving_get_their_own_greedy_tokens(model):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    short = SamplingParams(temperature=0.0, max_new_tokens=3)
    arrivals = {
        0: [("a", prompt_of(1, 7), greedy)],
        2: [("b", prompt_of(2, 40), greedy), ("c", prompt_of(3, 3), short)],
        5: [("d", prompt_of(4, 19), greedy)],
    }
    batch = DecodeBatch(model, capacity=4)
    got = _run(batch, arrivals)
    for requests in arrivals.values():
        for key, prompt, params in requests:
            assert got[key] == _alone(model, prompt, params), key
    assert len(got["c"]) == 3 and len(got["a"]) == 12
    assert len(batch) == 0


def test_stop_ids_end_a_member_and_the_others_go_on(model):
    prompt = prompt_of(5, 9)
    free = _alone(model, prompt, SamplingParams(temperature=0.0, max_new_tokens=10))
    stop = free[4]
    batch = DecodeBatch(model, eos_ids=(stop,), capacity=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    got = _run(batch, {0: [("s", prompt, params), ("t", prompt_of(6, 5), params)]})
    assert got["s"] == free[: free.index(stop) + 1]
    assert got["t"] == _alone(model, prompt_of(6, 5), params, eos=(stop,))


def test_seeded_sampling_in_the_batch_draws_what_alone_draws(model):
    """The same logits bit for bit and each member's own generator: the same sampled tokens."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=s) for s in (1, 2, 3)]
    prompts = [prompt_of(7, 6), prompt_of(8, 14), prompt_of(7, 6)]
    requests = list(enumerate(zip(prompts, params, strict=True)))
    got = _run(DecodeBatch(model, capacity=3), {0: [(i, p, q) for i, (p, q) in requests]})
    for i, (p, q) in requests:
        assert got[i] == _alone(model, p, q)
    assert got[0] != got[2]  # same prompt, other seeds


def test_a_request_handed_over_mid_way_continues_as_plain_decoding(model):
    """A request a decoder began alone (its cache holding the prompt and all emitted tokens but
    the last) joins the batch and ends with plain decoding's tokens and budget."""
    prompt = prompt_of(9, 11)
    params = SamplingParams(temperature=0.0, max_new_tokens=9)
    cache = model.new_cache(64)
    events = generate_ar(model, prompt, params, cache=cache)
    emitted = [t for _, ev in zip(range(4), events, strict=False) for t in ev.tokens]
    events.close()
    assert cache.length == len(prompt) + len(emitted) - 1
    batch = DecodeBatch(model, capacity=2)
    batch.join("h", prompt + emitted, params, cache=cache, reuse=cache.length, emitted=emitted)
    assert batch.members["h"].ready  # nothing to prefill: its last token is the next step's row
    got = _run(batch, {0: [("o", prompt_of(10, 4), params)]}, {"h": list(emitted)})
    assert got["h"] == _alone(model, prompt, params)
    assert got["o"] == _alone(model, prompt_of(10, 4), params)


def test_a_member_can_leave_and_the_batch_refuses_what_it_cannot_take(model):
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    batch = DecodeBatch(model, capacity=2)
    batch.join("x", prompt_of(1, 4), params)
    batch.join("y", prompt_of(2, 4), params)
    assert batch.full
    with pytest.raises(ValueError, match="full"):
        batch.join("z", prompt_of(3, 4), params)
    batch.leave("x")
    with pytest.raises(ValueError, match="already"):
        batch.join("y", prompt_of(3, 4), params)
    assert [k for k, _ in batch.advance()] == ["y"]
    batch.leave("missing")  # ignored
    with pytest.raises(ValueError, match="capacity"):
        DecodeBatch(model, capacity=0)
    with pytest.raises(ValueError, match="chunk"):
        DecodeBatch(model, chunk=0)
    with pytest.raises(ValueError, match="cannot step"):
        DecodeBatch(tiny_target(0))


def test_a_long_prompt_prefills_in_chunks_while_the_others_keep_stepping(model):
    """A 50-token prompt joins a running member with 8-token chunks: the running one gets a token
    at every advance until the newcomer's prefill event, whose time covers its chunks; both end
    with their own plain decoding's tokens, and the newcomer's cache holds what one prefill writes."""
    params = SamplingParams(temperature=0.0, max_new_tokens=30)
    batch = DecodeBatch(model, capacity=2, chunk=8)
    batch.join("a", prompt_of(1, 5), params)
    got = {"a": [t for _, ev in batch.advance() for t in ev.tokens]}
    long = prompt_of(2, 50)
    batch.join("b", long, params)
    got["b"], during = [], 0
    while not got["b"]:
        events = dict(batch.advance())
        got["a"] += events["a"].tokens
        if "b" in events:
            assert events["b"].prefill and events["b"].verify_s > 0
            got["b"] += events["b"].tokens
        else:
            during += 1
    assert during == 6  # 49 prompt tokens before its last one: 7 chunks of 8, the 7th with its first step
    ref = model.new_cache(64)
    model(torch.tensor([long[:-1]]), torch.arange(49), ref, logits="none")
    assert torch.equal(batch.members["b"].cache.k[:, :, :, :49], ref.k[:, :, :, :49])
    while len(batch):
        for key, ev in batch.advance():
            got[key] += ev.tokens
    assert got["a"] == _alone(model, prompt_of(1, 5), params)
    assert got["b"] == _alone(model, long, params)


def test_members_report_the_logprobs_their_plain_decoding_reports(model):
    """A batched row is bitwise the member's own step: its logprobs are equal, not just close."""
    asks = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=3)
    quiet = SamplingParams(temperature=0.0, max_new_tokens=8)
    batch = DecodeBatch(model, capacity=3, chunk=4)
    arrivals = {
        0: [("a", prompt_of(1, 9), asks), ("b", prompt_of(2, 5), quiet)],
        2: [("c", prompt_of(3, 13), asks)],
    }
    logprobs: dict[str, list] = {}
    step = 0
    while len(batch) or step <= 2:
        for key, prompt, params in arrivals.get(step, []):
            batch.join(key, prompt, params)
        for key, ev in batch.advance():
            assert (ev.logprobs is None) == (key == "b")
            logprobs.setdefault(key, []).extend(ev.logprobs or [])
        step += 1
    for key, prompt, _ in [*arrivals[0], *arrivals[2]]:
        if key == "b":
            continue
        alone = [lp for ev in generate_ar(model, prompt, asks) for lp in ev.logprobs]
        assert logprobs[key] == alone


def _adjusted_params(kind: str) -> SamplingParams:
    from evospec.decoding.json_grammar import JsonGrammar, TokenTable
    from evospec.decoding.penalties import Penalties
    from tests.decoding.test_json_mode import EOS, TOKENS

    if kind == "penalties":
        return SamplingParams(max_new_tokens=16, penalties=Penalties(0.7, 1.2, repetition=2.0))
    return SamplingParams(
        max_new_tokens=16, penalties=Penalties(grammar=JsonGrammar(TokenTable(TOKENS, [EOS], EOS + 1)))
    )


@pytest.mark.parametrize("kind", ["penalties", "json"])
def test_adjusted_members_pick_what_their_plain_decoding_picks(model, kind):
    """Each member counts its own output -- penalties, the JSON grammar's state -- and a
    handed-over one what it emitted before."""
    adjusted = _adjusted_params(kind)
    plain = SamplingParams(temperature=0.0, max_new_tokens=16)
    prompts = [prompt_of(4, 7), prompt_of(5, 12)]
    got = _run(DecodeBatch(model, capacity=3), {0: [(0, prompts[0], adjusted), (1, prompts[1], plain)]})
    assert got[0] == _alone(model, prompts[0], adjusted) and got[1] == _alone(model, prompts[1], plain)
    assert got[0] != _alone(model, prompts[0], plain)  # the adjustment changed something
    # handed over after 5 tokens: the 5 count from the start
    first = _alone(model, prompts[0], adjusted)
    batch = DecodeBatch(model, capacity=2)
    cache = model.new_cache(64)
    ids = [*prompts[0], *first[:5]]
    model(torch.tensor([ids[:-1]]), torch.arange(len(ids) - 1), cache, logits="none")
    batch.join("h", ids, adjusted, cache=cache, reuse=len(ids) - 1, emitted=first[:5])
    assert first[:5] + _run(batch, {}, {"h": []})["h"] == first

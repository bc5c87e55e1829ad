"""SamplingParams validation and the shared target distribution (temperature, top-k, top-p)."""

from __future__ import annotations

import math

import pytest
import torch

from evospec.decoding import sampling
from evospec.decoding.sampling import SAMPLING_EPS, SamplingParams, draw, greedy_ids, pick_token, target_probs

# probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order) as logits
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
LOGITS = PROBS.log()


def _sampled(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = 200) -> list[int]:
    gen = params.make_generator()
    return [pick_token(logits, params, gen) for _ in range(n)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
    ],
)
def test_invalid_params_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy and params.max_new_tokens == 128 and params.stop_ids == frozenset()


def test_greedy_is_argmax() -> None:
    params = SamplingParams()
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert pick_token(logits, params, None) == int(logits.argmax())
    assert pick_token(LOGITS, params, None) == 1
    with pytest.raises(ValueError, match="greedy"):
        target_probs(LOGITS, params)


def test_temperature_one_is_softmax() -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0))
    assert torch.allclose(probs, PROBS, atol=1e-6)


def test_temperature_sharpens_and_flattens() -> None:
    cold = target_probs(LOGITS, SamplingParams(temperature=0.5))
    hot = target_probs(LOGITS, SamplingParams(temperature=2.0))
    assert torch.allclose(cold, PROBS**2 / (PROBS**2).sum(), atol=1e-6)
    assert torch.allclose(hot, PROBS.sqrt() / PROBS.sqrt().sum(), atol=1e-6)


@pytest.mark.parametrize(
    ("k", "kept"), [(1, [1]), (2, [1, 3]), (3, [0, 1, 3]), (4, [0, 1, 2, 3]), (99, [0, 1, 2, 3])]
)
def test_top_k(k: int, kept: list[int]) -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=k))
    assert torch.nonzero(probs).flatten().tolist() == kept
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)
    assert torch.allclose(probs[kept], PROBS[kept] / PROBS[kept].sum(), atol=1e-6)


@pytest.mark.parametrize(
    ("p", "kept"), [(0.45, [1]), (0.55, [1, 3]), (0.7, [1, 3]), (0.85, [0, 1, 3]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_token_that_crosses_the_threshold(p: float, kept: list[int]) -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=p))
    assert torch.nonzero(probs).flatten().tolist() == kept
    assert torch.allclose(probs[kept], PROBS[kept] / PROBS[kept].sum(), atol=1e-6)


def test_top_k_then_top_p() -> None:
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # top-3 renormalised: 0.5/0.95, 0.3/0.95, 0.15/0.95 -> mass before the third is 0.84 >= 0.6
    assert torch.nonzero(probs).flatten().tolist() == [1, 3]


def test_batched_rows_are_independent() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=1))
    assert probs.argmax(-1).tolist() == [1, 2]


def test_same_seed_same_output() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert _sampled(params, logits) == _sampled(params, logits)
    other = SamplingParams(temperature=1.0, seed=4321)
    assert _sampled(params, logits) != _sampled(other, logits)


def test_filtered_tokens_are_never_sampled() -> None:
    assert set(_sampled(SamplingParams(temperature=1.0, top_k=2, seed=0), n=400)) == {1, 3}
    assert set(_sampled(SamplingParams(temperature=1.0, top_p=0.45, seed=0), n=100)) == {1}


def test_sampling_frequencies_follow_the_distribution() -> None:
    n = 4000
    draws = torch.tensor(_sampled(SamplingParams(temperature=1.0, seed=7), n=n))
    freq = torch.bincount(draws, minlength=4).float() / n
    # 5 standard deviations of a binomial proportion
    assert ((freq - PROBS).abs() <= 5 * (PROBS * (1 - PROBS) / n).sqrt()).all(), freq


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, SAMPLING_EPS / 2])
def test_temperature_below_epsilon_is_greedy(temperature: float) -> None:
    # logits / 1e-39 overflow to inf and the softmax to NaN: below the epsilon the sampler is argmax
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 50
    assert _sampled(params, logits, n=20) == [int(logits.argmax())] * 20


def test_temperature_at_epsilon_samples_a_finite_distribution() -> None:
    params = SamplingParams(temperature=SAMPLING_EPS)
    assert not params.greedy
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 50
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and math.isclose(probs.sum().item(), 1.0, rel_tol=1e-5)
    assert int(probs.argmax()) == int(logits.argmax())


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    # 5e-324 becomes 0.0 in float32: a plain "mass before >= top_p" mask would drop every token
    probs = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_greedy_ids_pick_as_argmax_does_with_ties_and_nans():
    """Few distinct values make ties everywhere; a NaN wins as in torch.argmax."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        logits = torch.randint(0, 4, (3, 5000), generator=gen).float()
        if trial % 5 == 0:
            logits[1, int(torch.randint(0, 5000, (1,), generator=gen))] = float("nan")
        assert torch.equal(greedy_ids(logits), torch.argmax(logits, dim=-1))
        assert int(greedy_ids(logits[2])) == int(torch.argmax(logits[2]))


def test_greedy_ids_agree_on_every_path_views_and_dtypes():
    """The numpy path (CPU float32) and torch's (other dtypes, tensors needing grad) pick the
    same ids: several NaNs (the first wins), strided views, one row or many, inference mode."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        logits = torch.randint(0, 4, (4, 3000), generator=gen).float()
        if trial % 3 == 0:
            logits[0, torch.randint(0, 3000, (3,), generator=gen)] = float("nan")
        want = torch.argmax(logits, dim=-1)
        for view, expect in ((logits, want), (logits[:, ::2], torch.argmax(logits[:, ::2], dim=-1))):
            got = greedy_ids(view)
            assert got.dtype == torch.int64 and torch.equal(got, expect)
        with torch.inference_mode():
            assert torch.equal(greedy_ids(logits.clone()), want)
        assert torch.equal(greedy_ids(logits.double()), want)
        assert torch.equal(greedy_ids(logits.requires_grad_()), want)
        assert int(greedy_ids(logits[3].detach())) == int(want[3])


def _full_sort_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus as a full descending sort defines it (the implementation before wave 32)."""
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_p.double().cumsum(-1) - sorted_p.double()
    drop = mass_before >= top_p
    drop[..., 0] = False
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("scale", [0.1, 1.0, 3.0, 10.0])
def test_top_p_finds_the_nucleus_a_full_sort_finds(scale: float) -> None:
    """Peaked rows (a few ids) and flat ones (thousands: the search past NUCLEUS_K), batched."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(3, 5000, generator=gen) * scale
    probs = torch.softmax(logits, dim=-1)
    sizes = set()
    for top_p in (1e-9, 0.3, 0.9, 0.95, 0.999, 1 - 1e-9):
        got = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        want = _full_sort_nucleus(probs, top_p)
        assert torch.equal(got > 0, want > 0), (scale, top_p)
        assert torch.allclose(got, want, atol=1e-6) and torch.allclose(got.sum(-1), torch.ones(3))
        sizes.update((got > 0).sum(-1).tolist())
    if scale <= 1.0:
        assert max(sizes) > 4 * sampling.NUCLEUS_K  # the search grew past its first k


def test_top_p_keeps_the_lowest_ids_among_equal_edge_probabilities() -> None:
    probs = torch.tensor([0.1, 0.3, 0.3, 0.3])  # mass before, descending: 0, 0.3, 0.6, 0.9
    got = target_probs(probs.log(), SamplingParams(temperature=1.0, top_p=0.35))
    assert torch.nonzero(got).flatten().tolist() == [1, 2]
    flat = target_probs(torch.zeros(8), SamplingParams(temperature=1.0, top_p=0.3))
    assert torch.nonzero(flat).flatten().tolist() == [0, 1, 2]  # 0, 1/8, 2/8 come before 0.3


def test_draw_follows_the_weights_and_never_draws_a_zero() -> None:
    weights = torch.tensor([0.2, 0.0, 1.2, 0.6, 0.0])  # unnormalised
    gen = torch.Generator().manual_seed(3)
    n = 4000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=5).float()
    want = weights / weights.sum()
    assert counts[1] == 0 and counts[4] == 0
    assert ((counts / n - want).abs() <= 5 * (want * (1 - want) / n).sqrt()).all(), counts


def test_draw_reproduces_with_a_seed_and_rejects_no_mass() -> None:
    weights = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    ids = [[draw(weights, torch.Generator().manual_seed(9)) for _ in range(3)] for _ in range(2)]
    assert ids[0] == ids[1]
    for bad in (torch.zeros(10), torch.tensor([0.5, float("nan")])):
        with pytest.raises(ValueError, match="mass"):
            draw(bad, None)


def test_a_draw_at_the_very_top_takes_the_last_id_with_mass(monkeypatch) -> None:
    """u x total rounded up to the total would fall past the end: the last id with mass."""
    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(torch.tensor([0.25, 0.75, 0.0, 0.0]), None) == 1


def test_top_p_after_top_k_and_underflow_sees_only_the_positive_ids() -> None:
    """Rows with thousands of zeros (top-k filtering; logits far apart, whose softmax underflows)
    keep the nucleus a full sort finds."""
    gen = torch.Generator().manual_seed(5)
    for logits, top_k in (
        (torch.randn(2, 5000, generator=gen) * 3, 40),
        (torch.randn(2, 5000, generator=gen) * 60, 0),
    ):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9)
        got = target_probs(logits, params)
        filtered = target_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
        assert (filtered == 0).sum() > 4000
        want = _full_sort_nucleus(filtered, 0.9)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6)


def test_top_k_keeps_ties_and_matches_the_masked_softmax() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 5000, generator=gen) * 3
    for k in (1, 40, 1000):
        got = target_probs(logits, SamplingParams(temperature=0.8, top_k=k))
        scaled = logits / 0.8
        kth = torch.topk(scaled, k, dim=-1).values[..., -1:]
        want = torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
        assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6)
    ties = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])  # the 2nd largest value is held by three ids
    got = target_probs(ties, SamplingParams(temperature=1.0, top_k=2))
    assert torch.nonzero(got).flatten().tolist() == [0, 2, 3, 4]
    nan = torch.tensor([0.0, float("nan"), 1.0])
    filters = ({"top_k": 1}, {"top_k": 2}, {"top_p": 0.9}, {"top_k": 2, "top_p": 0.9})
    for params in (SamplingParams(temperature=1.0, **f) for f in filters):
        with pytest.raises(ValueError, match="mass"):  # NaN logits: the draw says so, top-p passes them on
            pick_token(nan, params, None)

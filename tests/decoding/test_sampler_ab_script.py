"""``scripts/sampler_ab.py``: the sampler beside the one it replaced (wave 32)."""

from __future__ import annotations

import torch

import evospec.decoding.sampling as sampling
import evospec.decoding.verify as verify
from evospec.decoding.sampling import SamplingParams, pick_token, target_probs
from tests.script_modules import load_script


def test_arms_switch_every_caller_and_keep_the_same_distribution():
    script = load_script("sampler_ab")
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 2
    params = SamplingParams(temperature=0.8, top_k=200, top_p=0.9, seed=1)
    try:
        script.use("reference")
        assert sampling.draw is verify.draw is script.reference_draw
        assert sampling.target_probs is verify.target_probs is script.reference_target_probs
        ref = sampling.target_probs(logits, params)  # the module's name: the arm's function
        ref_ids = [pick_token(logits, params, torch.Generator().manual_seed(2)) for _ in range(3)]
    finally:
        script.use("this")
    assert sampling.target_probs is verify.target_probs is script.ARMS["this"][0]
    assert sampling.draw is verify.draw is script.ARMS["this"][1]
    this = target_probs(logits, params)
    assert torch.equal(ref > 0, this > 0) and torch.allclose(ref, this, atol=1e-6)
    kept = set(torch.nonzero(this).flatten().tolist())
    assert set(ref_ids) <= kept

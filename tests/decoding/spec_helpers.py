"""Tiny targets and drafters for speculative-decoding tests (no files, no real model)."""

from __future__ import annotations

import copy

import torch

from evospec.decoding.autoregressive import generate_ar
from evospec.decoding.drafter import EagleDrafter, FullHead, TargetDrafter
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.speculative import generate_speculative
from evospec.decoding.tree import TreeConfig
from evospec.models.config import ModelConfig
from evospec.models.eagle import new_eagle_for
from evospec.models.transformer import Transformer

VOCAB = 64


def tiny_target(
    seed: int = 0,
    *,
    family: str = "llama",
    sharp: float = 6.0,
    ctx: int = 160,
    vocab: int = VOCAB,
    eos: tuple[int, ...] = (),
    head_dim: int = 8,
) -> Transformer:
    """A random target whose next-token distributions are peaked (``sharp`` scales the head).
    ``head_dim`` 64 gives attention rows as long as real models' (SDPA then rounds otherwise
    than one-query attention)."""
    torch.manual_seed(seed)
    extra = {}
    if family == "gemma3":
        extra = dict(
            sliding_window=6,
            layer_types=("sliding_attention", "full_attention"),
            query_pre_attn_scalar=8.0,
            hidden_act="gelu_pytorch_tanh",
            qk_norm=True,
        )
    cfg = ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        max_position_embeddings=ctx,
        eos_token_ids=eos,
        **extra,
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp)
    return model


def perturbed_drafter(target: Transformer, noise: float, seed: int = 0) -> TargetDrafter:
    """A target copy with noisy weights drafting: partial acceptance, exercising every branch."""
    twin = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    return TargetDrafter(twin)


def eagle_drafter(target: Transformer, seed: int = 0) -> EagleDrafter:
    head = new_eagle_for(target, seed=seed)
    return EagleDrafter(head, FullHead(target.lm_head.weight))


def ar_tokens(target: Transformer, prompt: list[int], params: SamplingParams, eos=()) -> list[int]:
    return [t for ev in generate_ar(target, prompt, params, eos_ids=eos) for t in ev.tokens]


def spec_events(target, drafter, prompt, params, tree: TreeConfig, eos=(), prefetch: float | None = None):
    """``prefetch``: None verifies with every node's logits, a threshold with lazy rows."""
    return list(generate_speculative(target, drafter, prompt, params, tree, eos_ids=eos, prefetch=prefetch))


def spec_tokens(target, drafter, prompt, params, tree: TreeConfig, eos=(), prefetch=None) -> list[int]:
    return [t for ev in spec_events(target, drafter, prompt, params, tree, eos, prefetch) for t in ev.tokens]


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def exact_second_token(
    target, prompt: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """p(x2) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1), computed from the target directly (with
    top-k / top-p: each step's distribution as ``sampling.target_probs`` filters it)."""
    from evospec.decoding.sampling import SamplingParams, target_probs

    def next_probs(ids: list[int]) -> torch.Tensor:
        cache = target.new_cache(len(ids))
        logits = target(torch.tensor([ids]), torch.arange(len(ids)), cache, logits="last").logits[0, -1]
        if top_k or top_p < 1.0:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            return target_probs(logits, params).double()
        return torch.softmax(logits.double() / temperature, -1)

    p1 = next_probs(prompt)
    return sum(p1[x] * next_probs([*prompt, x]) for x in range(p1.numel()) if p1[x] > 1e-7)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit; bins expecting < 5 samples are pooled into one."""
    from scipy.stats import chi2

    n = float(counts.sum())
    expected = probs * n
    big = expected >= 5
    obs = [*counts[big].tolist(), float(counts[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return float(chi2.sf(stat, len(obs) - 1))


def sampled_second_tokens(dec, prompt: list[int], temperature: float, n: int) -> tuple[torch.Tensor, int]:
    """Counts [V] of the second generated token over ``n`` seeded requests of ``dec``, and the
    draft tokens accepted over all of them (what :func:`chi2_pvalue` tests against the law)."""
    counts = torch.zeros(dec.model.cfg.vocab_size)
    accepted = 0
    for s in range(n):
        evs = list(dec.generate(prompt, SamplingParams(max_new_tokens=2, temperature=temperature, seed=s)))
        counts[[t for ev in evs for t in ev.tokens][1]] += 1
        accepted += sum(ev.accepted for ev in evs)
    return counts, accepted


def steps_of(fn):
    """``fn`` as pausable steps (``decoding/pausable.py``): a generator that yields once, then
    returns ``fn``'s result."""

    def steps(*args, **kwargs):
        yield
        return fn(*args, **kwargs)

    return steps

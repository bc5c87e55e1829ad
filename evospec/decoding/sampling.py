"""Sampling parameters and the logits -> distribution transform shared by every method.

Owns: :class:`SamplingParams` and :func:`target_probs`, the one definition of "the target
distribution" (temperature, top-k, top-p). Plain decoding samples from it; speculative
verification accepts or rejects against exactly the same distribution, which is what makes
sampling lossless. Knows nothing about models or caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature < SAMPLING_EPS`` (0 included) means greedy (argmax)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # besides the model's EOS ids
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """Argmax: at a temperature this small, sampling is argmax anyway, and 1/T would overflow."""
        return self.temperature < SAMPLING_EPS

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the
    token that crosses the threshold is kept), matching the usual HF/vLLM convention.
    """
    if params.greedy:
        raise ValueError("target_probs is for sampling; greedy decoding uses argmax")
    logits = logits.float() / params.temperature
    if params.top_k:
        k = min(params.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop = mass_before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (a top_p below float32's range is 0.0)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension ([..., V] -> [...] int64), the first index among
    equal maxima (and the first NaN's where there is one), as ``torch.argmax`` decides. Paid
    once per decode step and per verified row: for CPU float32 logits through numpy's argmax,
    the same rule, ~5 us for a row of 49,152 timed alone against ~51 us for torch's ``max`` or
    ``argmax`` (torch 2.13, AMD EPYC; +0.6-0.7% on whole AR and ngram decodes, docs/benchmarks.md,
    wave 30), elsewhere through ``max``. Every greedy choice goes through here, so plain
    decoding and verification pick alike."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1)))
    return logits.max(dim=-1).indices


def pick_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from logits [V]: argmax when greedy, else a draw from :func:`target_probs`."""
    if params.greedy:
        return int(greedy_ids(logits))
    return int(torch.multinomial(target_probs(logits, params), 1, generator=gen))

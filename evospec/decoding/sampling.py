"""Sampling parameters and the logits -> distribution transform shared by every method.

Owns: :class:`SamplingParams`, :func:`target_probs`, the one definition of "the target
distribution" (temperature, top-k, top-p), and :func:`draw`, the one way a token is drawn from a
distribution. Plain decoding samples from it; speculative verification accepts or rejects
against exactly the same distribution, which is what makes sampling lossless. Knows nothing
about models or caches.

Cost on a CPU, one row of SmolLM2's 49,152 ids (AMD EPYC, docs/benchmarks.md, wave 32): the
distribution ~0.1 ms; a draw ~0.1 ms (torch's ``multinomial`` draws an exponential per id:
~1.3 ms); a nucleus found among the most likely ids ~0.2 ms (a full ``sort``: ~4.3 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from evospec.decoding.logprobs import MAX_TOP_LOGPROBS
from evospec.decoding.penalties import Generated, Penalties, adjusted

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS): 1/T would overflow
NUCLEUS_K = 256  # top-p looks for its nucleus among this many most likely ids first (x4 until found)


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
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: off)
    penalties: Penalties = field(default_factory=Penalties)  # presence, frequency, logit_bias

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")

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


def derived_seed(seed: int | None, index: int) -> int | None:
    """A seed of its own for part ``index`` of a seeded request -- a request's choice i > 0, the
    rest of a request that changed hands after ``index`` tokens -- so it never re-reads the draws
    ``seed`` gave; the same for the same (seed, index). None stays None."""
    if seed is None:
        return None
    return hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    Top-k keeps every token whose logit is at least the k-th largest (ties included). Top-p
    keeps the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that
    crosses the threshold is kept), matching the usual HF/vLLM convention.
    """
    if params.greedy:
        raise ValueError("target_probs is for sampling; greedy decoding uses argmax")
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        return _top_k_softmax(logits, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _nucleus(probs, params.top_p)
    return probs


def _top_k_softmax(logits: torch.Tensor, k: int, top_p: float = 1.0) -> torch.Tensor:
    """The softmax [..., V] over each row's logits at or above its k-th largest, zero elsewhere,
    and then its nucleus (``top_p`` < 1) among those few: a partition for the k-th value and the
    softmax of the kept few, ~0.1 ms a row of 49,152 here against ~0.4 ms for torch's ``topk``,
    mask and full softmax. A row with a NaN logit comes out NaN, as the full softmax would (a
    draw from it raises)."""
    return _by_row(logits, lambda row: _top_k_row(row, k, top_p))


def _top_k_row(row: np.ndarray, k: int, top_p: float) -> np.ndarray:
    out = np.zeros_like(row)
    if np.isnan(row.max()):  # numpy's max propagates NaN; a partition would rank it last
        out[:] = np.nan
        return out
    vocab = row.shape[0]
    ids = np.flatnonzero(row >= np.partition(row, vocab - k)[vocab - k])
    e = np.exp(row[ids] - row[ids].max())
    kept = e / e.sum()
    out[ids] = _nucleus_row(kept, top_p) if top_p < 1.0 else kept  # ids ascend: ties stay lowest first
    return out


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] kept on the smallest set of most likely ids whose mass reaches ``top_p``
    (the id that crosses it stays), renormalised. Ids of equal probability at the edge are
    kept from the lowest id up, so the set is a function of the probabilities alone."""
    return _by_row(probs, lambda row: _nucleus_row(row, top_p))


def _by_row(x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` ([V] float32 ndarray -> [V]) over each row of ``x`` [..., V], in numpy on the host
    (a CUDA tensor is copied there and back): torch's own elementwise calls cost ~25-35 us each
    on a row of 49,152 here, numpy's a few."""
    host = x.detach().cpu().reshape(-1, x.shape[-1]).numpy()
    return torch.from_numpy(np.stack([fn(row) for row in host])).to(x.device).view_as(x)


def _nucleus_row(p: np.ndarray, top_p: float) -> np.ndarray:
    """One row [V] of :func:`_nucleus`: the nucleus's size and its smallest probability come from
    the row's top values alone (:func:`_nucleus_edge`); every id above that edge is kept, and as
    many ids at the edge, lowest first, as make the size. A row without positive mass (NaN
    logits) passes through as it is: a draw from it raises."""
    positive = p[p > 0]  # a zero never joins the nucleus (the mass before it is the total)
    if not positive.size:
        return p
    edge, size = _nucleus_edge(positive, top_p)
    keep = p > edge
    missing = size - int(np.count_nonzero(keep))
    if missing > 0:
        keep[np.flatnonzero(p == edge)[:missing]] = True
    kept = p * keep
    return kept / kept.sum()


def _nucleus_edge(p: np.ndarray, top_p: float) -> tuple[np.float32, int]:
    """(the smallest probability in the nucleus, its size) from a row's positive values [n]: the
    mass before each of the top k values in descending order (float64), k = ``NUCLEUS_K`` and x4
    while the k-th value still comes before ``top_p`` -- numpy's partition and a sort of k
    values (~0.1 ms for k = 256 of 49,152 here, against ~4 ms for torch's ``sort`` of the row;
    partitioning the zeros as well, which top-k filtering and underflow leave by the thousand,
    took ~0.7 ms: its selection slows down on many equal values)."""
    vocab = p.shape[0]
    k = min(NUCLEUS_K, vocab)
    while True:
        top = np.sort(np.partition(p, vocab - k)[vocab - k :])[::-1]  # [k] descending
        mass_before = np.cumsum(top, dtype=np.float64) - top
        if k == vocab or mass_before[-1] >= top_p:
            break
        k = min(4 * k, vocab)
    size = max(int(np.count_nonzero(mass_before < top_p)), 1)  # the most likely id always stays
    return top[size - 1], size


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One id from ``probs`` [V] (non-negative, not necessarily summing to 1) with chance
    probs[i] / sum(probs): the first id whose float64 running mass exceeds one uniform draw
    times the total (an id of zero mass is never drawn). Raises ``ValueError`` where there is no
    positive finite mass (NaN logits), as ``multinomial`` would."""
    cdf = probs.double().cumsum(0)  # [V]
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"cannot draw from a distribution of total mass {total}")
    u = torch.rand((), dtype=torch.float64, generator=gen, device=probs.device) * total
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.shape[0]:  # u * total rounded up to the total: the last id with mass
        i = int(torch.nonzero(probs).max())
    return i


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


def pick_token(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    generated: Generated | None = None,
) -> int:
    """One token from logits [V] adjusted by ``params.penalties`` for the ids ``generated`` so
    far: argmax when greedy, else a draw from :func:`target_probs`."""
    logits = adjusted(logits, params.penalties, generated)
    if params.greedy:
        return int(greedy_ids(logits))
    return draw(target_probs(logits, params), gen)

"""Sampled draft proposals: a chain's tokens drawn from the draft's own distribution.

Owns: :class:`Proposal` (the distribution q one drafted token was drawn from, kept for the
verify) and :class:`DraftSampler` (the draft head's chooser under sampling: one draw per call,
each call's q recorded in order). Knows nothing about models or caches; the acceptance rule
that reads the proposals is ``verify.py``'s.

Why: under sampling, a chain that proposes the draft's most likely token is accepted with the
target's probability of that token, p(x) -- on text the target samples at temperature 1 that is
~0.31 of positions for SmolLM2's head (teacher-forced on Spec-Bench answers:
``scripts/live_gap.py --temperature 1.0``), against 0.43 for greedy agreement. Drawing x from
the draft's distribution q and accepting it with probability min(1, p(x) / q(x)) (speculative
sampling: Leviathan et al., ICML 2023; Chen et al., 2023) is accepted with probability
sum_x min(p(x), q(x)) = 1 - TV(p, q): ~0.45 on the same positions when q is the draft's softmax
at the request's temperature.

q leaves the request's top-k and top-p out: applied to q as well they added 0.010-0.017 to that
acceptance (T=1 with top_p 0.95; T=0.8, top_k 40, top_p 0.95) and cost 0.1-1 ms a draw over
SmolLM2's 49,152 ids on this CPU, where a draw at the temperature alone costs ~0.1-0.2 ms. Any
q keeps the output exact: a draw outside the target's filtered support is simply rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from evospec.decoding.sampling import SamplingParams, draw


@dataclass(frozen=True)
class Proposal:
    """The distribution a drafted token was drawn from: ``probs`` [C] over the draft head's
    columns, ``ids`` [C] the target id of each column (None: column c is id c; a free slot's id
    is -1, its probability 0), and ``token_prob`` = q(the drawn token)."""

    probs: torch.Tensor  # [C] float32, sums to 1
    ids: torch.Tensor | None  # [C] int64
    token_prob: float

    def dense(self, like: torch.Tensor) -> torch.Tensor:
        """q over the target's ids, shaped and typed like ``like`` [V] (zero off the columns)."""
        if self.ids is None:
            return self.probs.to(like.dtype)
        out = torch.zeros_like(like)
        held = self.probs > 0  # free slots (id -1) never hold mass
        out[self.ids[held]] = self.probs[held].to(like.dtype)
        return out


@dataclass
class DraftSampler:
    """A draft head's chooser (``vocab/head.py``: ``Chooser``) for one round's chain: each call
    draws one token from q = the softmax of the draft's log-probabilities at the request's
    temperature, and records q. Any q keeps the output lossless (the verify corrects for it); q
    close to the target's p is what gets tokens accepted."""

    params: SamplingParams
    gen: torch.Generator
    proposals: list[Proposal] = field(default_factory=list)  # one per call, in drafting order

    def __post_init__(self) -> None:
        if self.params.greedy:
            raise ValueError("a greedy request proposes the draft's most likely tokens; nothing to sample")

    def __call__(self, logp: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logp [1, C] the draft's log-probabilities over its columns, ``ids`` [C] their target
        ids (None: the column is the id) -> (log max q [1, 1], x [1, 1]) for one drawn token x.

        The score is the node's confidence, max q, not q(x): a chain that stops on its scores
        (``tree.min_prob``) then decides whether to keep a draw without looking at what was
        drawn, so every kept draw is distributed as q. (Stopping on q(x) would keep the likely
        draws and drop the others: the kept ones would follow another law than the q the verify
        divides by.)"""
        if logp.shape[0] != 1:
            raise ValueError(f"a sampled draft draws one token a call (a chain), got {logp.shape[0]} rows")
        q = torch.softmax(logp[0].float() / self.params.temperature, dim=-1)  # [C]
        col = draw(q, self.gen)
        token = col if ids is None else int(ids[col])
        q_token = float(q[col])
        # a copy: a reduced head rewrites its slots' ids in place when its active set changes
        self.proposals.append(Proposal(q, None if ids is None else ids.clone(), q_token))
        device = logp.device
        return (
            torch.tensor([[math.log(float(q.max()))]], device=device),
            torch.tensor([[token]], dtype=torch.long, device=device),
        )

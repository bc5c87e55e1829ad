"""Typed events that every decoding loop yields, and the stop rule they all share.

Owns: :class:`StepEvent` (what one step or round committed) and :class:`StopRule` (EOS, stop
ids, max_new_tokens, context end). Knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evospec.decoding.logprobs import TokenLogprob
    from evospec.vocab.active import VocabRoundStats


@dataclass
class StepEvent:
    """Tokens committed by one AR step or one speculative round.

    ``tokens`` = accepted draft tokens followed by the bonus token (AR: just one token),
    already clipped at a stop condition. Tokens per round = ``accepted + 1`` before clipping.
    """

    tokens: list[int]
    accepted: int = 0  # draft tokens the target agreed with (0 for AR)
    bonus: int | None = None  # the target's own token after the accepted ones (speculative rounds)
    tree_size: int = 0  # draft tokens verified this round (0 for AR)
    draft_s: float = 0.0  # wall time spent drafting
    verify_s: float = 0.0  # wall time of the target forward (AR: the decode step)
    finish_reason: str | None = None  # "stop" | "length" | None (keep going)
    round_s: float = 0.0  # wall time of the whole round: draft, verify and bookkeeping (0 for AR)
    prefill: bool = False  # the prompt's forward produced this token (not a round; MAL skips it)
    vocab: VocabRoundStats | None = None  # active-vocabulary facts of the round (speculative only)
    looked_up: bool = False  # the round verified a context lookup's tokens (or the root alone), not a draft
    cached_tokens: int = 0  # prefill event: prompt tokens whose K/V were reused, not computed
    logprobs: list[TokenLogprob] | None = None  # one per token (``SamplingParams.logprobs`` set)


@dataclass(frozen=True)
class StopRule:
    """When generation ends: an EOS/stop id (kept in the output), or the length budget."""

    stop_ids: frozenset[int]
    max_new_tokens: int

    def clip(self, new: list[int], produced: int) -> tuple[list[int], str | None]:
        """Cut ``new`` at the first stop id or at the budget; ``produced`` = tokens so far."""
        room = self.max_new_tokens - produced
        for i, tok in enumerate(new[:room]):
            if tok in self.stop_ids:
                return new[: i + 1], "stop"
        if len(new) >= room:
            return new[:room], "length"
        return new, None

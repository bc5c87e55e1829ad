"""The one fold over :class:`~evospec.decoding.events.StepEvent` s, and the one MAL.

Owns: :class:`RequestStats`, what a stream of step events adds up to -- for one request, a
benchmark run or a server's life (:meth:`RequestStats.merge`). Every consumer that counts
rounds, acceptance or time (the engine and its metrics, ``evospec generate``, ``evospec
bench`` and its topic-shift scenario, the replay) folds events through :meth:`RequestStats.add`
and reads MAL from :attr:`RequestStats.mal`, so there is one definition (docs/engine.md):

- A *round* is a draft+verify cycle, or one AR decode step. The prefill event (the prompt's
  forward and the first token) is no round: its time counts in ``prefill_s`` and ``verify_s``,
  its token in ``tokens``, nothing in ``rounds``, ``accepted`` or ``depth_counts``.
- **MAL** = mean tokens per round = ``accepted + 1`` per round, counted *before* clipping at a
  stop id or the length budget (plain decoding: 1.0). ``tokens`` is what was committed, after
  clipping, so ``tokens - 1`` can be less than ``rounds + accepted``.
- **Acceptance by depth** d = the share of rounds that accepted at least d draft tokens;
  summed over d it is ``MAL - 1``.

Knows events only: nothing about models, trees, tokenizers or how the numbers are shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from evospec.decoding.events import StepEvent
from evospec.vocab.active import VocabTotals


@dataclass
class RequestStats:
    """Step events folded: counts, wall times, vocabulary totals and acceptance depths."""

    tokens: int = 0  # committed tokens (after clipping), the prefill's first token included
    rounds: int = 0  # draft+verify rounds; for ar, decode steps after the prefill
    accepted: int = 0  # draft tokens the target agreed with (before clipping)
    draft_s: float = 0.0  # wall time drafting
    verify_s: float = 0.0  # wall time of target forwards (the prefill included)
    prefill_s: float = 0.0  # the prefill event's time (prompt forward + first token)
    round_s: float = 0.0  # whole-round wall time, summed (0 for ar)
    vocab: VocabTotals = field(default_factory=VocabTotals)  # speculative rounds only
    depth_counts: list[int] = field(default_factory=list)  # [max accepted] [d-1]: rounds accepting >= d
    drafted: int = 0  # rounds whose tokens a draft model proposed
    model_free: int = 0  # rounds that verified a context lookup's or the n-gram table's tokens
    cached_tokens: int = 0  # prompt tokens whose K/V a prefill reused (prefix reuse)

    def add(self, ev: StepEvent) -> None:
        """Fold one event in."""
        self.tokens += len(ev.tokens)
        self.draft_s += ev.draft_s
        self.verify_s += ev.verify_s
        if ev.prefill:
            self.prefill_s += ev.verify_s + ev.draft_s
            self.cached_tokens += ev.cached_tokens
            return
        self.rounds += 1
        self.accepted += ev.accepted
        self.round_s += ev.round_s
        if ev.tree_size:
            self.model_free += ev.looked_up
            self.drafted += not ev.looked_up
        if ev.accepted > len(self.depth_counts):
            self.depth_counts.extend([0] * (ev.accepted - len(self.depth_counts)))
        for d in range(ev.accepted):
            self.depth_counts[d] += 1
        if ev.vocab is not None:
            self.vocab.add(ev.vocab)

    def merge(self, other: RequestStats) -> None:
        """Add ``other`` (another request, or a run) to these totals."""
        self.tokens += other.tokens
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.prefill_s += other.prefill_s
        self.round_s += other.round_s
        self.drafted += other.drafted
        self.model_free += other.model_free
        self.cached_tokens += other.cached_tokens
        self.vocab.merge(other.vocab)
        if len(other.depth_counts) > len(self.depth_counts):
            self.depth_counts.extend([0] * (len(other.depth_counts) - len(self.depth_counts)))
        for d, n in enumerate(other.depth_counts):
            self.depth_counts[d] += n

    def copy(self) -> RequestStats:
        """An independent copy (nothing mutable is shared)."""
        return replace(self, vocab=self.vocab.copy(), depth_counts=list(self.depth_counts))

    @property
    def mal(self) -> float | None:
        """Mean acceptance length: tokens per round, accepted + 1, before clipping (ar: 1.0);
        the prefill is no round. None without rounds."""
        return (self.rounds + self.accepted) / self.rounds if self.rounds else None

    def acceptance_by_depth(self, depth: int | None = None) -> list[float]:
        """[depth] share of rounds that accepted at least d draft tokens, for d = 1..depth
        (default: the deepest acceptance seen; deeper entries are 0.0). Without rounds there
        are no shares: an empty list."""
        if not self.rounds:
            return []
        depth = len(self.depth_counts) if depth is None else depth
        counts = self.depth_counts[:depth] + [0] * max(depth - len(self.depth_counts), 0)
        return [n / self.rounds for n in counts]

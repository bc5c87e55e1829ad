"""Drafters: the draft side of a speculative round, with their own KV cache.

Owns: the draft cache and its bookkeeping across a round -- commit the pairs the target just
verified ("catch-up"), expand tree frontiers into uncommitted slots (each node sees the
committed prefix plus its own ancestors), and rewind those slots after verification, so draft
KV is kept only for accepted tokens. Top-k over the draft's output vocabulary goes through a
``DraftHeadFn`` (full LM head here; a reduced active-vocabulary head plugs in the same way),
or what a chooser picks instead (a sampled chain's draws: ``proposal.DraftSampler``).

- :class:`EagleDrafter`: an EAGLE-2 or EAGLE-3 head. Pair i = (target feature at position i,
  token i+1) sits at draft position i; a depth-d tree node's pair is (its parent's draft
  feature, its token) at position prefix_len - 1 + d. (An EAGLE-3 head's target feature is
  three target layers, fused by its ``fc``; its own features are one layer wide.)
- :class:`TargetDrafter`: the target model drafting for itself (the "perfect draft" used by
  tests: every drafted top-1 token is the target's own greedy choice).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from evospec.models.draft_step import draft_graph_for, on_cpu, supports_draft_graph
from evospec.models.eagle import EagleHead
from evospec.models.fused import draft_ids_apply, run_fused_draft_ids
from evospec.models.kv_cache import KVCache
from evospec.models.packing import projection
from evospec.models.transformer import Transformer
from evospec.vocab.head import Chooser, FullHead

__all__ = ["DraftHeadFn", "Drafter", "EagleDrafter", "FullHead", "TargetDrafter"]


class DraftHeadFn(Protocol):
    def __call__(
        self, hidden: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [n, D] -> top-k (log-probs [n, k], target token ids [n, k]); with ``choose``,
        what it picks from the log-probs instead (a sampled chain's draws)."""
        ...


class Drafter(Protocol):
    def start(self, prompt: Sequence[int], max_len: int) -> None: ...
    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor) -> None: ...
    def commit(
        self, features: torch.Tensor, tokens: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def expand(
        self, tokens: torch.Tensor, parent_rows: torch.Tensor | None, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rewind(self) -> None: ...


class _TreeDrafterBase:
    """Cache and mask bookkeeping shared by drafters; subclasses supply :meth:`_run`."""

    cache: KVCache
    graph = None  # a recorded causal step (EagleDrafter on the CPU); None: every step is eager

    def __init__(self, head_fn: DraftHeadFn) -> None:
        self.head_fn = head_fn
        self.committed = 0  # committed draft slots
        self._last: torch.Tensor | None = None  # [1, D] the last committed pair's draft feature
        self._frontier_hidden: torch.Tensor | None = None  # [k', D] inputs for the children
        self._anc: torch.Tensor | None = None  # [k', tree slots so far] frontier ancestors
        self._depth = 0

    def _new_cache(self, max_len: int) -> KVCache:
        raise NotImplementedError

    def _run(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor | int,
        mask: torch.Tensor | None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Forward n inputs ([n, D] features, [n] tokens) into the cache; return [n, D].
        ``positions``: [n], or (``causal``) the first of n consecutive ones. ``causal``: each
        input sees the cache and the inputs before it (``mask`` None: an eager layer that needs
        that spelled out takes :meth:`_causal_mask`; a recorded or fused step attends so by
        itself)."""
        raise NotImplementedError

    def _causal_mask(self, n: int) -> torch.Tensor | None:
        """[n, cache.length + n] bool: each of n new inputs sees the cache and the inputs before
        it; None where no mask is needed (an empty cache: plain causal; one input: everything)."""
        prefix = self.cache.length
        if not prefix or n == 1:
            return None
        return torch.ones(n, prefix + n, dtype=torch.bool, device=self.cache.k.device).tril(prefix)

    def start(self, prompt: Sequence[int], max_len: int) -> None:
        if getattr(self, "cache", None) is None or self.cache.max_len < max_len:
            self.cache = self._new_cache(max_len)
        self.cache.reset()
        self.committed = 0

    def _base_position(self) -> int:
        """Position of the first pair committed next (EAGLE: pair index)."""
        return self.committed

    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append verified pairs (features [m, D], tokens [m], m >= 1) to the draft cache, each
        seeing the cache and the pairs before it; the last one's draft feature is kept for the
        next :meth:`commit` (the prompt's pairs at prefill, a round's at its start)."""
        hidden = self._run(features, tokens, self._base_position(), None, causal=True)  # [m, D]
        self.committed = self.cache.length
        self._last = hidden[-1:]

    def commit(
        self, features: torch.Tensor, tokens: torch.Tensor, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append verified pairs (features [m, D], tokens [m]; m may be 0 after a
        :meth:`catch_up`) and return the root's top-k [k] (or what ``choose`` picks): the tree
        grows from the last pair."""
        if tokens.shape[0]:
            self.catch_up(features, tokens)
        self._frontier_hidden = self._last
        self._anc = torch.zeros(1, 0, dtype=torch.bool, device=tokens.device)
        self._depth = 0
        logp, ids = self.head_fn(self._last, k, choose)
        return logp[0], ids[0]

    def expand(
        self, tokens: torch.Tensor, parent_rows: torch.Tensor | None, k: int, choose: Chooser | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward frontier nodes (tokens [k']) into uncommitted slots; children's top-k [k', k]
        (or what ``choose`` picks)."""
        n = tokens.shape[0]
        rows = (
            parent_rows if parent_rows is not None else torch.zeros(n, dtype=torch.long, device=tokens.device)
        )
        parent_hidden = self._frontier_hidden[rows]  # [k', D]
        anc = torch.cat([self._anc[rows], torch.eye(n, dtype=torch.bool, device=tokens.device)], dim=1)
        mask = torch.cat([torch.ones(n, self.committed, dtype=torch.bool, device=tokens.device), anc], dim=1)
        self._depth += 1
        position = self._base_position() - 1 + self._depth
        # a chain's next node (its ancestors are every tree slot): checked only where a recorded
        # step could use it, so a GPU drafter never reads the mask back
        causal = self.graph is not None and n == 1 and bool(anc.all())
        positions = position if causal else torch.full((n,), position, device=tokens.device)
        hidden = self._run(parent_hidden, tokens, positions, mask, causal)  # [k', D]
        self._frontier_hidden, self._anc = hidden, anc
        return self.head_fn(hidden, k, choose)

    def rewind(self) -> None:
        """Drop the tree slots written since the last commit."""
        self.cache.trim(self.committed)


class EagleDrafter(_TreeDrafterBase):
    """``record``: run causal steps (chains, catch-ups) through recorded graphs where the head
    allows (``models/draft_step.py``; CPU, a head whose weights do not move)."""

    def __init__(self, head: EagleHead, head_fn: DraftHeadFn, *, record: bool = False) -> None:
        super().__init__(head_fn)
        self.head = head
        self.graph = None
        if record and supports_draft_graph(head) and on_cpu(head):
            self.graph = draft_graph_for(head)
        # a fused int4 head's causal steps as one draft_step_ids op, RoPE rows from these tables
        # (False: the recorded step; scripts/drafting_ab.py compares the two)
        self.ids_op = record and draft_ids_apply(head)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [L, Dh]

    def _new_cache(self, max_len: int) -> KVCache:
        return self.head.new_cache(max_len)

    def _rope_rows(self, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables covering positions 0 .. upto - 1 (grown by doubling, kept across requests)."""
        if self._rope is None or self._rope[0].shape[0] < upto:
            have = 0 if self._rope is None else self._rope[0].shape[0]
            positions = torch.arange(max(upto, 2 * have, 1024), device=self.head.rope.inv_freq.device)
            cos, sin = self.head.rope(positions, torch.float32)
            self._rope = cos.contiguous(), sin.contiguous()
        return self._rope

    @torch.inference_mode()
    def _run(self, features, tokens, positions, mask, causal=False) -> torch.Tensor:
        if isinstance(positions, int):  # causal rows from this position
            n = tokens.shape[0]
            if self.ids_op and features.dtype == torch.float32:
                rope = self._rope_rows(positions + n)
                return run_fused_draft_ids(self.head, features, tokens, positions, rope, self.cache)
            positions = torch.arange(positions, positions + n, device=tokens.device)
        if causal and self.graph is not None:
            out = self.graph(features, tokens, positions, self.cache)
            if out is not None:
                return out
        if causal and getattr(self.head, "fused_step", False):
            mask = None  # its one op attends causally behind the cache (a long catch-up, an expansion)
        elif causal and mask is None:
            mask = self._causal_mask(tokens.shape[0])
        return self.head(features[None], tokens[None], positions, self.cache, mask)[0]


class TargetDrafter(_TreeDrafterBase):
    """The target drafting for itself: feeds token x_{i+1} at position i+1 and ignores features."""

    def __init__(self, model: Transformer, head_fn: DraftHeadFn | None = None) -> None:
        super().__init__(head_fn or FullHead(model.lm_head.weight, projection(model.lm_head)))
        self.model = model
        self._first: int | None = None

    def _new_cache(self, max_len: int) -> KVCache:
        return self.model.new_cache(max_len + 1)

    def start(self, prompt: Sequence[int], max_len: int) -> None:
        super().start(prompt, max_len)
        self._first = prompt[0]

    def _base_position(self) -> int:
        # The target cache holds x_0 in an extra slot; pair i corresponds to x_{i+1} at i + 1.
        return max(self.committed - 1, 0)

    def _run(self, features, tokens, positions, mask, causal=False) -> torch.Tensor:
        device = tokens.device
        if isinstance(positions, int):  # causal rows from this position
            positions = torch.arange(positions, positions + tokens.shape[0], device=device)
        if self.cache.length == 0:  # prepend x_0 so the context is complete
            tokens = torch.cat([torch.tensor([self._first], device=device), tokens])
            positions = torch.cat([positions[:1] * 0, positions + 1])
            out = self.model(tokens[None], positions, self.cache, logits="none")
            return out.hidden[0, 1:]
        if causal and mask is None:
            mask = self._causal_mask(tokens.shape[0])
        out = self.model(tokens[None], positions + 1, self.cache, attn_mask=mask, logits="none")
        return out.hidden[0]

"""Prefix reuse: a decoder's KV cache keeps its last sequence between requests, and a prompt
that starts with the same tokens prefills only the rest (a chat's next turn, a shared system
prompt).

Owns: :class:`PrefixCache`, one per decoder -- the token ids whose K/V sit in the cache's first
slots, and for drafted methods the target's features there (what the draft head reads of
those positions) -- with :meth:`PrefixCache.reusable` (how many slots a prompt keeps) and
:meth:`PrefixCache.track` (record what a request leaves in the cache), and
:func:`reuse_is_exact` (which models may reuse at all).

Lossless by construction, not by approximation: reuse is on only where every forward of the
target is row-exact (``Transformer.fused_ops``: prefill, one-token steps and verified chains
write bitwise the K/V and features that feeding the tokens one at a time writes;
``tests/models/test_fused.py``). There the cache's slots are a function of the tokens alone,
so a request's output with reused slots equals its output from an empty cache, bit for bit,
whatever the method and whatever ran before. Elsewhere (Gemma's sliding layers, fp32 and GPU
paths) ``reusable`` is always 0.

What a request leaves: its prompt and every token it emitted but the last -- the slots plain
decoding has written by then (a speculative round may have written more; those are not
counted, so what the next request reuses does not depend on the method).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from evospec.decoding.events import StepEvent
from evospec.models.transformer import Transformer


def reuse_is_exact(model: Transformer) -> bool:
    """Whether ``model``'s cached slots equal a fresh prefill's bitwise (see the module doc)."""
    return bool(getattr(model, "fused_ops", False) and getattr(model, "exact_rows", False))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """The tokens (and optionally per-slot features) behind a decoder's cache slots [0, n)."""

    def __init__(self, model: Transformer, *, enabled: bool = True) -> None:
        self.enabled = enabled and reuse_is_exact(model)
        self.tokens: list[int] = []  # ids of the valid slots [0, len(tokens))
        # per-slot target features (drafted methods): what the draft reads, [capacity, D'], and
        # the final features, [capacity, D], where those differ (EAGLE-3; None: the same)
        self.features: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def reusable(self, prompt: Sequence[int]) -> int:
        """Slots ``prompt`` may keep: the prefix it shares with the cached tokens, leaving at
        least its last token to prefill (its logits choose the first new token)."""
        if not self.enabled or len(prompt) < 2:
            return 0
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)

    def write(self, start: int, features: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Keep the target's features at slots [start, start + n): ``features`` [n, D'] (what
        the draft reads) and ``hidden`` [n, D] (final features; None: they are ``features``,
        as for EAGLE-2 heads)."""
        end = start + features.shape[0]
        self.features = _grown(self.features, end, features, start)
        self.features[start:end] = features
        if hidden is None:
            self.hidden = None
        else:
            self.hidden = _grown(self.hidden, end, hidden, start)
            self.hidden[start:end] = hidden

    def final_features(self, end: int) -> torch.Tensor:
        """[end, D]: the final features kept at slots [0, end)."""
        buf = self.features if self.hidden is None else self.hidden
        assert buf is not None
        return buf[:end]

    def track(self, prompt: Sequence[int], events: Iterator[StepEvent]) -> Iterator[StepEvent]:
        """``events``, passed through; afterwards the cached tokens are the prompt and the
        emitted tokens but the last (nothing, if the request failed: its slots may be half
        written). A request closed between rounds (cancelled) still leaves a whole cache."""
        self.tokens = []
        emitted: list[int] = []
        try:
            for ev in events:
                emitted += ev.tokens
                yield ev
        except Exception:
            emitted = []
            raise
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()
            if emitted:
                self.tokens = [*prompt, *emitted[:-1]]


def _grown(buf: torch.Tensor | None, end: int, like: torch.Tensor, keep: int) -> torch.Tensor:
    """``buf`` when it holds ``end`` rows of ``like``'s width, else a larger one keeping rows [0, keep)."""
    if buf is not None and buf.shape[0] >= end and buf.shape[1:] == like.shape[1:]:
        return buf
    new = like.new_empty((max(end, 2 * (buf.shape[0] if buf is not None else 0), 256), *like.shape[1:]))
    if buf is not None and keep and buf.shape[1:] == like.shape[1:]:
        new[:keep] = buf[:keep]
    return new

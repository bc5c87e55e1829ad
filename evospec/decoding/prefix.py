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

Requests batched by the engine (``decoding/batch.py``) keep caches of their own: :meth:`PrefixCache.lend`
copies a joining prompt's longest shared run of slots -- from the live cache or a snapshot, K/V
only -- into its cache, and :meth:`PrefixCache.remember` keeps a finished member's slots as a
snapshot (not for drafted decoders, whose snapshots must carry features the batch never computes).

Several recent sequences: before a request overwrites slots the cache holds (a prompt that
differs from the last request's), :meth:`PrefixCache.prepare` copies those slots -- K/V and
kept features -- into a small store of snapshots (least recently used out first, within
``store_bytes``); a later prompt that shares a longer prefix with a snapshot than with the live
cache gets the snapshot's slots copied back instead of prefilling them (what llama.cpp's
server does with its prompt cache): clients that alternate between long documents or system
prompts each keep theirs. Copies of exact slots: just as lossless.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from evospec.decoding.budget import cache_for
from evospec.decoding.events import StepEvent
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer

STORE_MB = 256  # default room for snapshots of earlier sequences (--prefix-cache-mb)
MIN_SNAPSHOT = 128  # shorter sequences are not kept: prefilling them again costs little
MIN_GAIN = 64  # a snapshot replaces the live cache's prefix only where it keeps this many more slots


@dataclass
class _Snapshot:
    """Slots [0, n) of an earlier sequence: its tokens, K/V and kept features."""

    tokens: tuple[int, ...]
    k: torch.Tensor  # [L, 1, H_kv, n, Dh]
    v: torch.Tensor
    features: torch.Tensor | None  # [n, D'] (drafted methods) or None
    hidden: torch.Tensor | None  # [n, D] where it differs from features (EAGLE-3)

    @property
    def nbytes(self) -> int:
        parts = (self.k, self.v, self.features, self.hidden)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)


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
        self.model = model
        self.enabled = enabled and reuse_is_exact(model)
        self.store_bytes = STORE_MB << 20  # room for snapshots of earlier sequences; 0: none
        self.store: list[_Snapshot] = []  # least recently used first
        self.min_snapshot, self.min_gain = MIN_SNAPSHOT, MIN_GAIN
        # a drafted decoder (SpeculativeDecoder with a drafter) reuses slots only with their
        # features: snapshots of batched requests, which have none, are not kept for it
        self.needs_features = False
        self.tokens: list[int] = []  # ids of the valid slots [0, len(tokens))
        # per-slot target features (drafted methods): what the draft reads, [capacity, D'], and
        # the final features, [capacity, D], where those differ (EAGLE-3; None: the same)
        self.features: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def forget(self) -> None:
        """Hold nothing: the next request prefills its whole prompt (a benchmark's warm-up must
        not leave its prompt behind for the timed runs)."""
        self.tokens = []
        self.store.clear()

    def reusable(self, prompt: Sequence[int]) -> int:
        """Slots ``prompt`` may keep: the prefix it shares with the cached tokens, leaving at
        least its last token to prefill (its logits choose the first new token)."""
        if not self.enabled or len(prompt) < 2:
            return 0
        return min(common_prefix(self.tokens, prompt), len(prompt) - 1)

    @torch.inference_mode()  # the kept features are inference tensors (written by forwards)
    def prepare(self, cache: KVCache | None, prompt: Sequence[int], slots: int) -> tuple[KVCache, int]:
        """The KV cache for a request needing ``slots`` slots, and how many of ``prompt``'s slots
        it already holds: the live cache's shared prefix, or a stored snapshot's where that is
        longer (copied in, with its features). Slots the request will overwrite are stored first."""
        live = self.reusable(prompt)
        best, source = live, None
        if self.enabled and len(prompt) >= 2:
            for snap in self.store:
                n = min(common_prefix(snap.tokens, prompt), len(prompt) - 1)
                if n >= best + self.min_gain:
                    best, source = n, snap
        if cache is not None and len(self.tokens) > (live if source is None else 0):
            self._keep(cache)  # the live sequence is about to be overwritten past `live`
        if source is None:
            return cache_for(self.model, cache, slots, keep=live), live
        cache = cache_for(self.model, cache, slots, keep=0)
        cache.k[:, :, :, :best] = source.k[:, :, :, :best]
        cache.v[:, :, :, :best] = source.v[:, :, :, :best]
        cache.advance(best)
        self.tokens = list(source.tokens[:best])
        if source.features is not None:
            self.write(0, source.features[:best], None if source.hidden is None else source.hidden[:best])
        self.store.remove(source)
        self.store.append(source)  # most recently used
        return cache, best

    @torch.inference_mode()
    def lend(self, prompt: Sequence[int], live: KVCache | None, dst: KVCache) -> int:
        """Copy into ``dst`` (emptied first) the K/V of the longest run of slots ``prompt`` shares
        with the live cache (``live``, holding :attr:`tokens`) or a snapshot, leaving its last
        token to prefill; returns how many slots ``dst`` now holds. Nothing here changes but the
        snapshots' recency."""
        dst.reset()
        if not self.enabled or len(prompt) < 2:
            return 0
        best, source = 0, None
        if live is not None and live.length >= len(self.tokens):
            best = self.reusable(prompt)
        for snap in self.store:
            n = min(common_prefix(snap.tokens, prompt), len(prompt) - 1)
            if n > best:
                best, source = n, snap
        if source is not None:
            self.store.remove(source)
            self.store.append(source)  # most recently used
        if best:
            src = live if source is None else source
            dst.k[:, :, :, :best] = src.k[:, :, :, :best]
            dst.v[:, :, :, :best] = src.v[:, :, :, :best]
        dst.advance(best)
        return best

    @torch.inference_mode()
    def remember(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep slots [0, len(tokens)) of ``cache`` (another sequence's: a batched request's
        prompt and emitted tokens but the last) as a K/V-only snapshot, within the store's room;
        not for a drafted decoder (:attr:`needs_features`)."""
        n = len(tokens)
        if self.needs_features or not self.enabled or n < self.min_snapshot or cache.length < n:
            return
        k, v = cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()
        self._store(_Snapshot(tuple(tokens), k, v, None, None))

    def _store(self, snap: _Snapshot) -> None:
        """Add ``snap`` unless the store has it (or a longer run of it) or it cannot fit; drop
        the snapshots it extends, then the least recently used past the store's room."""
        tokens = snap.tokens
        if snap.nbytes > self.store_bytes or any(s.tokens[: len(tokens)] == tokens for s in self.store):
            return
        self.store = [s for s in self.store if tokens[: len(s.tokens)] != s.tokens]  # prefixes of it
        self.store.append(snap)
        while sum(s.nbytes for s in self.store) > self.store_bytes:
            self.store.pop(0)

    def _keep(self, cache: KVCache) -> None:
        """Store the live cache's valid slots as a snapshot (if long enough and room allows)."""
        n = len(self.tokens)
        if not self.enabled or n < self.min_snapshot or cache.batch != 1 or cache.max_len < n:
            return
        if self.features is not None and self.features.shape[0] < n:
            return  # a drafted decoder's features must come with its slots
        tokens = tuple(self.tokens)
        if any(snap.tokens[:n] == tokens for snap in self.store):
            return  # already kept (or a longer run of it): no copy
        feats = None if self.features is None else self.features[:n].clone()
        hidden = None if self.hidden is None or feats is None else self.hidden[:n].clone()
        k, v = cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()
        self._store(_Snapshot(tokens, k, v, feats, hidden))

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

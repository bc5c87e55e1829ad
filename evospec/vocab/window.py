"""NanoSpec's candidate stream and its sliding window, kept on the device.

Owns: the last ``w_max`` entries of the candidate stream (a ring buffer) and, for every token
id, how many of those entries it is (a count over the vocabulary). From them the active set

    active = Unique(Suffix(stream, w_max))        (NanoSpec, section 3)

is read as a ``[V]`` bool mask: an id is active exactly while at least one of its occurrences
is among the last ``w_max`` stream entries, so eviction is "least recently appended".

It does not know what the entries are (prompt tokens, prefill top-K, draft-tree tokens,
verify top-K) nor their order inside one push; the caller builds the stream. It does not
know slots or LM-head rows either: the mask goes to the reduced head.

Shapes are static: the ring is ``[w_max]`` and the counts ``[V]`` for the whole request.
:meth:`CandidateWindow.push` works with tensor ops only (no host synchronisation).
:meth:`CandidateWindow.push_padded` takes a fixed-size candidate buffer whose entries ``< 0``
are skipped (e.g. ``evospec.kernels.window.unique_padded`` of the draft tree), so the number
of entries it appends stays on the device; the stream length then lives in a device scalar
too. On CUDA both pushes run the Triton kernel of ``evospec.kernels.window``; elsewhere the
torch code (a plain push whose stream length is known on the host keeps the original
host-arithmetic path). Reading :meth:`active_ids`, :attr:`size` or, after a padded push,
:attr:`stream_length` synchronises, because their value depends on the data.
"""

from __future__ import annotations

import torch

from evospec.kernels.dispatch import Backend, pick_backend
from evospec.kernels.window import window_push

EMPTY = -1  # ring entry that holds no stream entry yet


class CandidateWindow:
    """Sliding window of width ``w_max`` over a stream of token ids in ``[0, vocab_size)``."""

    def __init__(
        self,
        vocab_size: int,
        w_max: int = 3072,
        device: str | torch.device = "cpu",
        backend: Backend | None = None,
    ) -> None:
        if vocab_size < 1 or w_max < 1:
            raise ValueError(f"vocab_size and w_max must be >= 1, got {vocab_size}, {w_max}")
        self.vocab_size = vocab_size
        self.w_max = w_max
        self.device = torch.device(device)
        # stream entry with global index g lives at ring[g % w_max]
        self.ring = torch.full((w_max,), EMPTY, dtype=torch.int64, device=self.device)  # [w_max]
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)  # [V]
        self._slots = torch.arange(w_max, dtype=torch.int64, device=self.device)  # [w_max]
        self._ones = torch.ones(w_max, dtype=torch.int32, device=self.device)  # [w_max]
        self._head = torch.zeros(1, dtype=torch.int64, device=self.device)  # [1] entries pushed
        self._length: int | None = 0  # the same on the host; None after a padded push
        self.backend: Backend = backend or pick_backend(self.device)

    def reset(self) -> None:
        """Empty stream, empty window."""
        self.ring.fill_(EMPTY)
        self.counts.zero_()
        self._head.zero_()
        self._length = 0

    @property
    def stream_length(self) -> int:
        """Entries pushed since the last reset (including those already out of the window)."""
        return self._length if self._length is not None else int(self._head)

    def push(self, ids: torch.Tensor) -> None:
        """Append ``ids`` ([n], in order) to the stream; the oldest entries fall out of the window.

        Every occurrence counts (duplicates included). When ``n > w_max`` only the last
        ``w_max`` can be in the window, so only those are written. Ids must lie in
        ``[0, vocab_size)``; that is not checked (it would need a host sync).
        """
        if ids.ndim != 1:
            raise ValueError(f"push expects a 1-D tensor of ids, got shape {tuple(ids.shape)}")
        n = ids.shape[0]
        if n == 0:
            return
        if self.backend != "torch" or self._length is None:
            window_push(self.ring, self.counts, self._head, ids, self.backend)
            if self._length is not None:
                self._length += n
            return
        k = min(n, self.w_max)
        new = ids[n - k :].to(device=self.device, dtype=torch.int64)  # [k]
        # the last k of stream indices length .. length+n-1; their slots (distinct, as k <= w_max)
        # hold exactly the entries that leave the window
        start = (self._length + n - k) % self.w_max
        slots = (self._slots[:k] + start) % self.w_max  # [k]
        old = self.ring[slots]  # [k]
        left = old >= 0  # [k] slot held a stream entry
        idx = torch.cat([old.clamp(min=0), new])  # [2k]
        delta = torch.cat([-left.to(torch.int32), self._ones[:k]])  # [2k]
        self.counts.index_add_(0, idx, delta)
        self.ring[slots] = new
        self._head.add_(n)
        self._length += n

    def push_padded(self, ids: torch.Tensor) -> None:
        """Append the entries ``>= 0`` of ``ids`` ([n], in order); entries ``< 0`` are skipped.

        Same window semantics as :meth:`push` on ``ids[ids >= 0]``, but the count of appended
        entries never leaves the device (afterwards :attr:`stream_length` synchronises).
        """
        if ids.ndim != 1:
            raise ValueError(f"push expects a 1-D tensor of ids, got shape {tuple(ids.shape)}")
        if ids.shape[0] == 0:
            return
        window_push(self.ring, self.counts, self._head, ids, self.backend)
        self._length = None

    def active_mask(self) -> torch.Tensor:
        """[V] bool: ids occurring among the last ``w_max`` stream entries."""
        return self.counts > 0

    def active_ids(self) -> torch.Tensor:
        """[size] int64: the active ids, ascending (synchronises: data-dependent size)."""
        return torch.nonzero(self.counts > 0).flatten()

    @property
    def size(self) -> int:
        """Number of active ids (synchronises)."""
        return int((self.counts > 0).sum())

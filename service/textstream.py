"""Generated token ids -> text deltas, with OpenAI ``stop`` strings applied.

Owns: :class:`TextAssembler`, the edge between the engine (token ids) and the API (text).
Text is produced incrementally (no split multi-byte characters); a ``stop`` string ends the
completion as soon as the generated text contains it, and the returned text stops just before
it (OpenAI semantics). While stop strings are set, text that could be the start of one is held
back, so a streamed delta never has to be taken back. ``tokens_used`` counts the tokens up to
and including the one that completed the stop string (what ``usage.completion_tokens`` reports).
Knows nothing about HTTP or the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from evospec.tokenizer import IncrementalDecoder, TextCodec


@dataclass(frozen=True)
class Piece:
    """What one batch of new tokens added."""

    text: str  # the new text that may be sent now
    stopped: bool  # a stop string was found: the completion is over


class TextAssembler:
    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stops = tuple(s for s in stops if s)
        self._detok = IncrementalDecoder(codec)
        self._held = ""  # decoded text not sent yet (a possible stop-string prefix)
        self.text = ""  # all text sent so far
        self.tokens_used = 0
        self.stopped = False

    def push(self, tokens: Sequence[int]) -> Piece:
        """Feed newly generated ids; returns the text that is safe to send."""
        if self.stopped:
            return Piece("", True)
        if not self.stops:  # no stop strings: one decode per batch
            self.tokens_used += len(tokens)
            return self._emit(self._detok.push(list(tokens)), final=False)
        out = []
        for tok in tokens:  # token by token, so the stop is pinned to the token that made it
            self.tokens_used += 1
            piece = self._emit(self._detok.push([tok]), final=False)
            out.append(piece.text)
            if piece.stopped:
                return Piece("".join(out), True)
        return Piece("".join(out), False)

    def finish(self) -> Piece:
        """The rest of the text once generation ended (incomplete characters, held text)."""
        if self.stopped:
            return Piece("", True)
        return self._emit(self._detok.flush(), final=True)

    def _emit(self, delta: str, *, final: bool) -> Piece:
        pending = self._held + delta
        cut = _first_stop(pending, self.stops)
        if cut is not None:
            self.stopped = True
            self._held = ""
            self.text += pending[:cut]
            return Piece(pending[:cut], True)
        keep = 0 if final else _held_suffix(pending, self.stops)
        send = pending[: len(pending) - keep]
        self._held = pending[len(pending) - keep :]
        self.text += send
        return Piece(send, False)


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best

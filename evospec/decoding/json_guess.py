"""Jump-forward guesses under a JSON grammar: verify what the grammar leaves no choice about.

Owns: :class:`JsonGuess`, one request's model-free proposal while its output is held to a JSON
grammar (JSON mode, a schema, a tool call): from where the output stands, the bytes the grammar
forces -- a schema's next property name with its quotes and colon, the quote that opens a string
value, the bracket that must close -- written with the whitespace this answer has used at the
same place so far, then tokenized as the model's tokenizer writes them. A speculative round
verifies those tokens as it verifies context lookup's (``speculative.py``), so a tool call's
``", "unit": "`` costs one round instead of four.

Whitespace is the one freedom inside forced structure (``{"a": 1}`` and ``{ "a" : 1 }`` are the
same JSON), and the grammar alone cannot say which the model writes. The answer can: the run of
whitespace that followed each structural byte at each depth is remembered as the answer is
verified, and a guess repeats it (before anything is known: one space after ``:`` and ``,``,
none elsewhere). A wrong guess costs a rejected row, never a token: the target verifies every
guessed token under the same grammar mask as any other (lossless by construction).

SGLang calls this jump-forward decoding; here it is a draft, not a shortcut, so the output is
token for token what plain decoding under the grammar writes. Knows bytes and token ids only.
"""

from __future__ import annotations

from collections.abc import Sequence

from evospec.decoding.json_grammar import AFTER, DONE, LIT, PKEY, JsonGrammar, JsonState

_WS = frozenset(b" \t\n\r")
# the whitespace guessed after a structural byte before the answer has shown its own
_DEFAULT_WS = {ord(":"): b" ", ord(","): b" "}
MAX_GUESS_BYTES = 64  # a guess's forced text at most (a long property name and its neighbours)


class JsonGuess:
    """One request's forced-structure guesses: ``extend`` with each verified token of the output
    (its first included), ``propose`` at each round."""

    def __init__(self, grammar: JsonGrammar, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"jump-forward guesses need limit >= 1, got {limit}")
        self.grammar, self.limit = grammar, limit
        self.state: JsonState = grammar.start()
        self._last: tuple[int, int] | None = None  # (the last non-whitespace byte, depth after it)
        self._run = b""  # whitespace written since that byte, where the grammar is between tokens
        # (byte, next byte, depth) -> the whitespace between them, the latest last
        self._style: dict[tuple[int, int, int], bytes] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        """Follow verified tokens byte by byte, learning the answer's whitespace (a token the
        grammar refuses -- EOS, a cut value -- leaves the state where it was, as
        :meth:`JsonGrammar.advance` does)."""
        pieces = self.grammar.table.pieces
        for tok in tokens:
            piece = pieces[tok] if 0 <= tok < len(pieces) else None
            if piece is not None:
                self._follow(piece)

    def _follow(self, piece: bytes) -> None:
        """One token's bytes: the state after them and the whitespace learned on the way, or
        nothing changed where the grammar refuses a byte."""
        step, state, last, run = self.grammar.machine.step, self.state, self._last, self._run
        learned = []
        for b in piece:
            before, state = state, step(state, b)
            if state is None:
                return
            if b in _WS and state.mode <= AFTER:
                run += bytes([b])
                continue
            if before.mode <= AFTER and last is not None:
                learned.append(((last[0], b, last[1]), run))
            last, run = (b, len(state.frames)), b""
        for key, ws in learned:
            self._style.pop(key, None)
            self._style[key] = ws
        self.state, self._last, self._run = state, last, run

    def propose(self) -> list[int]:
        """Up to ``limit`` tokens of the text the grammar forces from here; [] where the next
        byte is the model's choice."""
        text = self._forced()
        if not text:
            return []
        return self.grammar.table.encode(text)[: self.limit]

    def _forced(self) -> bytes:
        """The forced bytes from the current state, with the answer's whitespace between them."""
        grammar, step = self.grammar, self.grammar.machine.step
        state, last, run, out = self.state, self._last, self._run, bytearray()
        while len(out) < MAX_GUESS_BYTES and state.mode != DONE:
            between = state.mode <= AFTER
            if not (between or state.mode in (PKEY, LIT)):
                break  # a string's, a number's text: the model's
            b = grammar.only_byte(state)
            if b is None:
                break
            if between:
                pad = self._whitespace(last, b)
                pad = pad[len(run) :] if pad.startswith(run) else b""
                for w in pad:
                    nxt = step(state, w)
                    if nxt is None:
                        break
                    state = nxt
                    out.append(w)
                run = b""
            nxt = step(state, b)
            if nxt is None:  # the whitespace ran past the grammar's limit
                break
            state = nxt
            out.append(b)
            last = (b, len(state.frames))
        return bytes(out)

    def _whitespace(self, last: tuple[int, int] | None, nxt: int) -> bytes:
        """The whitespace this answer wrote between ``last`` (a byte, the depth after it) and
        ``nxt``: at that depth if seen there, else the latest seen at any depth, else the
        default."""
        if last is None:
            return b""
        seen = self._style.get((last[0], nxt, last[1]))
        if seen is not None:
            return seen
        for (byte, after, _), ws in reversed(self._style.items()):
            if (byte, after) == (last[0], nxt):
                return ws
        return _DEFAULT_WS.get(last[0], b"")

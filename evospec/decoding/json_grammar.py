"""JSON mode: which tokens keep a generated text a prefix of one JSON object.

Owns: :class:`JsonState` (where a text stands in the JSON grammar: the open containers and the
lexer's position), :func:`step` (one byte), and :class:`JsonGrammar`, one model's token table
with :meth:`JsonGrammar.allowed` (the [V] mask of tokens whose bytes the state accepts; EOS only
once the object is closed) and :meth:`JsonGrammar.advance`. A request with
``response_format: {"type": "json_object"}`` picks from rows whose disallowed tokens are set to
-inf (``penalties.adjusted``), so every method -- plain steps, each verified draft node with its
own path, batch members -- picks from the same constrained rows: greedy output is the same, and
sampling follows the constrained distribution, whichever method serves the request.

The grammar is RFC 8259's with three limits a served model needs: the top level is an object
(OpenAI's JSON mode), whitespace between tokens runs at most :data:`MAX_WS` bytes (a model that
keeps emitting newlines must close the object instead), and containers nest at most
:data:`MAX_DEPTH` deep. Strings are checked byte by byte (escapes, no control bytes); bytes of
128 and above pass, as a byte-level tokenizer splits characters across tokens.

Masks are computed once per state and kept (:data:`CACHE_STATES` of them): the tokens whose
first two bytes the state rejects are ruled out with two table lookups, the tokens made only of
plain string bytes are accepted inside a string without a walk, and only the rest are walked
byte by byte. Knows bytes and token ids only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_WS = 20  # whitespace bytes in a row between tokens of the grammar
MAX_DEPTH = 16  # open containers
CACHE_STATES = 512  # masks kept, least recently used dropped

# lexer positions
TOP, VALUE, FIRST_ITEM, FIRST_KEY, KEY, COLON, AFTER = range(7)  # between tokens
KEY_STR, STR = 7, 8  # inside a key / a value string; aux: 0, or "\\" after a backslash, or "uN"
NUM = 9  # inside a number; aux: the number's part so far (see _NUM_NEXT)
LIT = 10  # inside true / false / null; aux: the bytes still expected
DONE = 11  # the object is closed: only EOS

_WS = frozenset(b" \t\n\r")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
# a number's parts: "-" sign, "0" a leading zero, "int" digits, "." a dot, "frac" digits after
# it, "e" the exponent mark, "esign" its sign, "exp" its digits; which end a number
_NUM_DONE = frozenset({"0", "int", "frac", "exp"})


@dataclass(frozen=True)
class JsonState:
    """``stack``: the open containers, ``{`` or ``[`` each, outermost first. ``aux``: the
    whitespace run between tokens, or the string / number / literal's own progress."""

    mode: int = TOP
    stack: str = ""
    aux: int | str = 0


def _num_next(part: str, b: int) -> str | None:
    digit = b in _DIGITS
    if part == "-":
        return "0" if b == ord("0") else "int" if digit else None
    if part == "0":
        return "." if b == ord(".") else "e" if b in b"eE" else None
    if part == "int":
        return "int" if digit else "." if b == ord(".") else "e" if b in b"eE" else None
    if part == ".":
        return "frac" if digit else None
    if part == "frac":
        return "frac" if digit else "e" if b in b"eE" else None
    if part == "e":
        return "exp" if digit else "esign" if b in b"+-" else None
    return "exp" if digit else None  # "esign", "exp"


def _value_start(stack: str, b: int) -> JsonState | None:
    """A value begins with byte ``b`` inside ``stack``."""
    if b == ord('"'):
        return JsonState(STR, stack, 0)
    if b in b"{[":
        if len(stack) >= MAX_DEPTH:
            return None
        return JsonState(FIRST_KEY if b == ord("{") else FIRST_ITEM, stack + chr(b), 0)
    if b == ord("-"):
        return JsonState(NUM, stack, "-")
    if b in _DIGITS:
        return JsonState(NUM, stack, "0" if b == ord("0") else "int")
    if b in _LITERALS:
        return JsonState(LIT, stack, _LITERALS[b].decode())
    return None


def _closed(stack: str) -> JsonState:
    """A value just ended inside ``stack`` (the top-level object: done)."""
    return JsonState(AFTER, stack, 0) if stack else JsonState(DONE)


def _between(state: JsonState, b: int) -> JsonState | None:
    """Byte ``b`` where the grammar expects a token (modes TOP .. AFTER)."""
    mode, stack = state.mode, state.stack
    if b in _WS:
        return JsonState(mode, stack, state.aux + 1) if state.aux < MAX_WS else None
    if mode == TOP:
        return JsonState(FIRST_KEY, "{", 0) if b == ord("{") else None
    if mode == VALUE:
        return _value_start(stack, b)
    if mode == FIRST_ITEM:
        return _closed(stack[:-1]) if b == ord("]") else _value_start(stack, b)
    if mode in (FIRST_KEY, KEY):
        if b == ord('"'):
            return JsonState(KEY_STR, stack, 0)
        return _closed(stack[:-1]) if b == ord("}") and mode == FIRST_KEY else None
    if mode == COLON:
        return JsonState(VALUE, stack, 0) if b == ord(":") else None
    # AFTER a value inside a container
    top = stack[-1]
    if b == ord(","):
        return JsonState(KEY if top == "{" else VALUE, stack, 0)
    if b == ord("}" if top == "{" else "]"):
        return _closed(stack[:-1])
    return None


def _in_string(state: JsonState, b: int) -> JsonState | None:
    mode, stack, aux = state.mode, state.stack, state.aux
    if aux == "\\":
        if b == ord("u"):
            return JsonState(mode, stack, "u0")
        return JsonState(mode, stack, 0) if b in _ESCAPES else None
    if isinstance(aux, str):  # "uN": N hex digits of a \u escape read
        if b not in _HEX:
            return None
        n = int(aux[1]) + 1
        return JsonState(mode, stack, 0 if n == 4 else f"u{n}")
    if b == ord('"'):
        return JsonState(COLON, stack, 0) if mode == KEY_STR else _closed(stack)
    if b == ord("\\"):
        return JsonState(mode, stack, "\\")
    return None if b < 0x20 else state


def step(state: JsonState, b: int) -> JsonState | None:
    """The state after byte ``b``; None where ``b`` cannot follow."""
    mode = state.mode
    if mode <= AFTER:
        return _between(state, b)
    if mode in (KEY_STR, STR):
        return _in_string(state, b)
    if mode == NUM:
        part = _num_next(state.aux, b)
        if part is not None:
            return JsonState(NUM, state.stack, part)
        return _between(_closed(state.stack), b) if state.aux in _NUM_DONE else None
    if mode == LIT:
        if b != ord(state.aux[0]):
            return None
        rest = state.aux[1:]
        return JsonState(LIT, state.stack, rest) if rest else _closed(state.stack)
    return None  # DONE


def walk(state: JsonState | None, data: bytes) -> JsonState | None:
    """The state after ``data``; None where a byte of it cannot follow."""
    for b in data:
        if state is None:
            return None
        state = step(state, b)
    return state


def _plain(b: int) -> bool:
    """A byte a string takes as it is."""
    return b >= 0x20 and b not in b'"\\'


class JsonGrammar:
    """One model's tokens under the JSON grammar. ``pieces[i]``: token i's bytes, None for a
    token that is never text (special / added tokens); ``eos_ids`` end the text once the
    object is closed; ``vocab_size``: the model's row length (>= len(pieces))."""

    def __init__(self, pieces: Sequence[bytes | None], eos_ids: Sequence[int], vocab_size: int) -> None:
        if vocab_size < len(pieces):
            raise ValueError(f"JSON grammar: {len(pieces)} token pieces for a {vocab_size}-token row")
        if not eos_ids:
            raise ValueError("JSON grammar: the model names no EOS token to end the object with")
        self.pieces = [p if p else None for p in pieces]
        self.eos_ids = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self.vocab_size = vocab_size
        n = len(self.pieces)
        first = torch.full((vocab_size,), 256, dtype=torch.long)  # 256: no byte (never text)
        second = torch.full((vocab_size,), 256, dtype=torch.long)  # 256: a one-byte token
        plain = torch.zeros(vocab_size, dtype=torch.bool)
        for i, p in enumerate(self.pieces):
            if p is not None:
                first[i] = p[0]
                if len(p) > 1:
                    second[i] = p[1]
                plain[i] = all(map(_plain, p))
        self._pair = first * 257 + second  # [V] index into a state's (first, second) table
        self._plain = plain
        self._texts = torch.tensor([p is not None for p in self.pieces] + [False] * (vocab_size - n))
        self._cache: OrderedDict[JsonState, torch.Tensor] = OrderedDict()

    @classmethod
    def for_codec(cls, codec, eos_ids: Sequence[int], vocab_size: int) -> JsonGrammar:
        """The grammar of ``codec``'s tokens (``TextCodec``)."""
        added = set(codec.added_ids)
        pieces = [None if i in added else codec.token_bytes(i) for i in range(codec.vocab_size)]
        return cls(pieces, eos_ids, vocab_size)

    def start(self) -> JsonState:
        return JsonState()

    def advance(self, state: JsonState, tokens: Sequence[int]) -> JsonState:
        """The state after ``tokens`` (picked from :meth:`allowed` rows). EOS and tokens the
        state rejects -- a handed-over text, ``max_tokens`` cutting the object -- leave the
        state where the grammar can still say something: DONE stays DONE, a rejected token
        leaves it as it was."""
        for tok in tokens:
            piece = self.pieces[tok] if 0 <= tok < len(self.pieces) else None
            nxt = walk(state, piece) if piece is not None else None
            state = nxt if nxt is not None else state
        return state

    def allowed(self, state: JsonState) -> torch.Tensor:
        """[V] bool: the tokens that may come next in ``state`` (only EOS once DONE)."""
        return ~self.blocked(state)

    def blocked(self, state: JsonState) -> torch.Tensor:
        """[V] bool: the tokens that may not come next in ``state`` (kept: do not modify)."""
        mask = self._cache.get(state)
        if mask is not None:
            self._cache.move_to_end(state)
            return mask
        mask = ~self._compute(state)
        self._cache[state] = mask
        if len(self._cache) > CACHE_STATES:
            self._cache.popitem(last=False)
        return mask

    def _compute(self, state: JsonState) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if state.mode == DONE:
            mask[self.eos_ids] = True
            return mask
        # every (first, second) byte pair the state takes: 257 * 257 cells, 256 = "no byte"
        pairs = torch.zeros(257, 257, dtype=torch.bool)
        seconds: dict[JsonState, torch.Tensor] = {}  # after a first byte: [257] second bytes taken
        for b1 in range(256):
            s1 = step(state, b1)
            if s1 is None:
                continue
            if s1 not in seconds:
                row = torch.tensor([step(s1, b2) is not None for b2 in range(256)] + [True])
                seconds[s1] = row
            pairs[b1] = seconds[s1]
        pairs = pairs.flatten()
        live = pairs[self._pair] & self._texts  # [V]: first two bytes accepted
        if state.mode in (KEY_STR, STR) and state.aux == 0:
            mask |= live & self._plain  # plain string bytes stay in the string
            live &= ~self._plain
        for i in live.nonzero().flatten().tolist():
            if walk(state, self.pieces[i]) is not None:
                mask[i] = True
        return mask

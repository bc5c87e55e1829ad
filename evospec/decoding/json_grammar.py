"""JSON mode and JSON schemas: which tokens keep a generated text a prefix of a JSON value the
schema describes.

Owns: :class:`JsonState` (where a text stands: the open containers with their progress, the
value being read, the lexer's position), :class:`JsonMachine` (one schema's byte automaton:
:meth:`JsonMachine.step`, :meth:`JsonMachine.walk`) and :class:`JsonGrammar` (a model's
``json_tokens.TokenTable`` and a schema: :meth:`JsonGrammar.blocked`, the [V] mask of tokens
whose bytes the state refuses -- everything but EOS once the value is closed, EOS before --,
:meth:`JsonGrammar.advance`, and :meth:`JsonGrammar.only_byte`, what ``json_guess.py`` guesses
from). A request with ``response_format`` ``json_object``
(the schema ``json_schema.OBJECT``) or ``json_schema`` picks from rows whose blocked tokens are
-inf (``penalties.adjusted``), so every method -- plain steps, each verified draft node with its
own path, batch members -- picks from the same constrained rows: greedy output is the same, and
sampling follows the constrained distribution, whichever method serves the request.

The grammar is RFC 8259's, narrowed by the schema (``json_schema.py``: properties in the
schema's order, enums, unions that begin differently), with two limits a served model needs:
whitespace between tokens runs at most :data:`MAX_WS` bytes (a model that keeps emitting
newlines must go on with the value instead) and containers nest at most :data:`MAX_DEPTH` deep.
Strings are checked byte by byte (escapes, no control bytes); bytes of 128 and above pass, as a
byte-level tokenizer splits characters across tokens.

Masks are computed once per state and kept (:data:`CACHE_BYTES` of them a grammar): the tokens
whose first two bytes the state refuses are ruled out with one table lookup, the tokens made
only of plain string bytes are accepted inside a free string without a walk, and only the rest
are walked byte by byte. Knows bytes and token ids only.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evospec.decoding import json_formats
from evospec.decoding.json_regex import Pattern
from evospec.decoding.json_schema import (
    ANY_ARRAY,
    ANY_OBJECT,
    NUMBER,
    OBJECT,
    STRING,
    TRUE_FALSE_NULL,
    Schema,
    first_bytes,
)
from evospec.decoding.json_tokens import TokenTable

MAX_WS = 20  # whitespace bytes in a row between tokens of the grammar
MAX_DEPTH = 16  # open containers
# masks kept per grammar (a byte a token: 341 of 49k tokens), least recently used dropped
CACHE_BYTES = 16 << 20

# lexer positions; between tokens (aux: the whitespace run so far):
VALUE, FIRST_ITEM, FIRST_KEY, KEY, COLON, AFTER = range(6)
KEY_STR, STR = 6, 7  # in a free key / a string value; aux: 0, "\\" after a backslash, or "uN"
PKEY = 8  # in a property's name; aux: its bytes so far
NUM = 9  # in a number; aux: the number's part so far (see _num_next)
LIT = 10  # in a literal (true / false / null, an enum's text); aux: its bytes so far
DONE = 11  # the root value is closed: only EOS
BSTR = 12  # in a string with length bounds; aux: (escape as in STR, code points so far)
BINT = 13  # in an integer with bounds, while they still matter; aux: its text so far
FMT = 14  # in a string of a format; aux: where its automaton stands (json_formats.py)

_WS = frozenset(b" \t\n\r")
_TOKEN_STARTS = b'"{}[],:-0123456789tfn'  # what may begin a JSON token (a value, or , : } ])
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_ESCAPES = frozenset(b'"\\/bfnrt')
_ANY_START = {
    ord('"'): STRING,
    ord("{"): ANY_OBJECT,
    ord("["): ANY_ARRAY,
    **dict.fromkeys(b"tfn", TRUE_FALSE_NULL),
}
# a number's parts: "-" sign, "0" a leading zero, "int" digits, "." a dot, "frac" digits after
# it, "e" the exponent mark, "esign" its sign, "exp" its digits; these end a number:
_NUM_DONE = frozenset({"0", "int", "frac", "exp"})
_OBJECTS = -1  # a union's dispatch for "{" where it has several objects


@dataclass(frozen=True)
class JsonState:
    """``frames``: the open containers, outermost first, as (node, progress): an array's items
    so far (up to its largest bound), an object's next property position. ``node``: the value
    expected (VALUE, COLON) or being read (STR, NUM, LIT). ``aux``: the whitespace run, or the
    token's own progress."""

    mode: int
    frames: tuple[tuple[int, int], ...] = ()
    node: int = -1
    aux: int | str | bytes = 0


def _num_next(part: str, b: int, integer: bool) -> str | None:
    digit = b in _DIGITS
    if part == "-":
        return "0" if b == ord("0") else "int" if digit else None
    if integer:
        return "int" if part == "int" and digit else None
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


class JsonMachine:
    """One schema's byte automaton."""

    def __init__(self, schema: Schema) -> None:
        self.schema, self.nodes = schema, schema.nodes
        # a union's node by the byte its value begins with (json_schema checks they differ)
        self._dispatch = {
            i: {b: a for a in n.alts if a not in n.objects for b in first_bytes(schema, a)}
            | ({ord("{"): _OBJECTS} if n.objects else {})
            for i, n in enumerate(self.nodes)
            if n.kind == "union"
        }
        # a literals node's texts as a trie: prefix -> (the bytes that go on from it, complete)
        self._lits = {i: _trie((t, True) for t in n.literals) for i, n in enumerate(self.nodes) if n.literals}
        self._names: dict[tuple[int, Any], dict[bytes, tuple[frozenset[int], tuple]]] = {}

    def start(self) -> JsonState:
        return JsonState(VALUE, (), self.schema.root, 0)

    def walk(self, state: JsonState | None, data: bytes) -> JsonState | None:
        """The state after ``data``; None where a byte of it cannot follow."""
        for b in data:
            if state is None:
                return None
            state = self.step(state, b)
        return state

    def step(self, state: JsonState, b: int) -> JsonState | None:
        """The state after byte ``b``; None where ``b`` cannot follow."""
        mode = state.mode
        if mode <= AFTER:
            if b in _WS:
                return (
                    JsonState(mode, state.frames, state.node, state.aux + 1) if state.aux < MAX_WS else None
                )
            return self._between(state, b)
        if mode in (KEY_STR, STR):
            return self._in_string(state, b)
        if mode == BSTR:
            return self._in_bounded(state, b)
        if mode == PKEY:
            return self._in_name(state, b)
        if mode == NUM:
            part = _num_next(state.aux, b, self.nodes[state.node].kind == "integer")
            if part is not None:
                return JsonState(NUM, state.frames, state.node, part)
            return self.step(self._closed(state.frames), b) if state.aux in _NUM_DONE else None
        if mode == LIT:
            return self._in_literal(state, b)
        if mode == BINT:
            return self._in_bounded_int(state, b)
        if mode == FMT:
            fmt = self.nodes[state.node].fmt
            if b == ord('"'):
                return self._closed(state.frames) if json_formats.done(fmt, state.aux) else None
            at = json_formats.step(fmt, state.aux, b)
            return None if at is None else JsonState(FMT, state.frames, state.node, at)
        return None  # DONE

    def candidates(self, state: JsonState) -> Sequence[int] | frozenset[int]:
        """The bytes that may follow ``state`` (a superset; whitespace left out between tokens,
        where it is always free): a JSON token's first bytes, a property name's next ones."""
        if state.mode <= AFTER:
            return _TOKEN_STARTS
        if state.mode == PKEY:
            more, tags = self._name_trie(*state.frames[-1])[state.aux]
            return more | {ord('"')} if tags else more
        return range(256)

    def _between(self, state: JsonState, b: int) -> JsonState | None:
        """Byte ``b`` (not whitespace) where the grammar expects a token (modes VALUE .. AFTER)."""
        mode, frames = state.mode, state.frames
        if mode == VALUE:
            return self._value_start(frames, state.node, b)
        if mode == COLON:
            return JsonState(VALUE, frames, state.node, 0) if b == ord(":") else None
        if mode == DONE or not frames:
            return None
        top, progress = frames[-1]
        n = self.nodes[top]
        if n.kind == "union":
            return self._between_objects(state, top, progress, b)
        if n.kind == "array":
            if b == ord("]") and progress >= n.min_items:
                return self._closed(frames[:-1])
            more = n.max_items is None or progress < n.max_items
            item = n.prefix[progress] if progress < len(n.prefix) else n.items
            if mode == FIRST_ITEM:
                return self._value_start(frames, item, b) if more else None
            return JsonState(VALUE, frames, item, 0) if b == ord(",") and more else None
        free = not n.props  # free keys (or none at all: {})
        if b == ord("}") and mode in (FIRST_KEY, AFTER) and (free or self._may_close(top, progress)):
            return self._closed(frames[:-1])
        if mode == AFTER:
            more = n.extra is not None if free else progress < len(n.props)
            return JsonState(KEY, frames, -1, 0) if b == ord(",") and more else None
        if b != ord('"') or (n.extra is None if free else progress >= len(n.props)):
            return None
        return JsonState(KEY_STR, frames, n.extra, 0) if free else JsonState(PKEY, frames, -1, b"")

    def _value_start(self, frames: tuple[tuple[int, int], ...], node: int, b: int) -> JsonState | None:
        n = self.nodes[node]
        if n.kind == "any":
            start = NUMBER if b in _DIGITS or b == ord("-") else _ANY_START.get(b)
            return None if start is None else self._value_start(frames, start, b)
        if n.kind == "union":
            alt = self._dispatch[node].get(b)
            if alt == _OBJECTS:  # one of several objects: which, the keys written will tell
                if len(frames) >= MAX_DEPTH:
                    return None
                return JsonState(FIRST_KEY, (*frames, (node, tuple((a, 0) for a in n.objects))), -1, 0)
            return None if alt is None else self._value_start(frames, alt, b)
        if n.kind in ("object", "array"):
            if b != ord("{" if n.kind == "object" else "[") or len(frames) >= MAX_DEPTH:
                return None
            return JsonState(FIRST_KEY if n.kind == "object" else FIRST_ITEM, (*frames, (node, 0)), -1, 0)
        if n.kind == "string":
            if b != ord('"'):
                return None
            if n.fmt:
                return JsonState(FMT, frames, node, json_formats.start(n.fmt))
            if not n.min_len and n.max_len is None:
                return JsonState(STR, frames, node, 0)
            return JsonState(BSTR, frames, node, (0, 0))
        if n.kind == "integer" and (n.low is not None or n.high is not None):
            return self._in_bounded_int(JsonState(BINT, frames, node, ""), b)
        if n.kind in ("number", "integer"):
            if b == ord("-"):
                return JsonState(NUM, frames, node, "-") if n.low is None else None  # minimum 0: no sign
            return JsonState(NUM, frames, node, "0" if b == ord("0") else "int") if b in _DIGITS else None
        return self._in_literal(JsonState(LIT, frames, node, b""), b)

    def _closed(self, frames: tuple[tuple[int, Any], ...], text: bytes | None = None) -> JsonState:
        """A value just ended inside ``frames`` (the root value: done); ``text``: a literal's,
        which keeps only the objects of a union whose property takes it."""
        if not frames:
            return JsonState(DONE)
        top, progress = frames[-1]
        n = self.nodes[top]
        if n.kind == "union" and text is not None:
            live = tuple((a, p) for a, p in progress if self._takes(a, p - 1, text))
            return JsonState(AFTER, (*frames[:-1], (top, live)), -1, 0)
        if n.kind == "array":  # items counted only as far as the bounds and the prefix tell them apart
            cap = max(n.min_items, n.max_items or 0, len(n.prefix))
            frames = (*frames[:-1], (top, min(progress + 1, cap)))
        return JsonState(AFTER, frames, -1, 0)

    def _in_string(self, state: JsonState, b: int) -> JsonState | None:
        mode, frames, node, aux = state.mode, state.frames, state.node, state.aux
        if aux == "\\":
            if b == ord("u"):
                return JsonState(mode, frames, node, "u0")
            return JsonState(mode, frames, node, 0) if b in _ESCAPES else None
        if isinstance(aux, str):  # "uN": N hex digits of a \u escape read
            if b not in _HEX:
                return None
            n = int(aux[1]) + 1
            return JsonState(mode, frames, node, 0 if n == 4 else f"u{n}")
        if b == ord('"'):
            return JsonState(COLON, frames, node, 0) if mode == KEY_STR else self._closed(frames)
        if b == ord("\\"):
            return JsonState(mode, frames, node, "\\")
        return None if b < 0x20 else state

    def _in_bounded(self, state: JsonState, b: int) -> JsonState | None:
        """A string with length bounds: as :meth:`_in_string`, counting code points (an escape
        is one; UTF-8 continuation bytes are none) up to the larger bound."""
        n = self.nodes[state.node]
        esc, count = state.aux
        counted = min(count + 1, max(n.min_len, n.max_len or 0))

        def at(esc: int | str, count: int) -> JsonState:
            return JsonState(BSTR, state.frames, state.node, (esc, count))

        if esc == "\\":
            if b == ord("u"):
                return at("u0", count)
            return at(0, counted) if b in _ESCAPES else None
        if isinstance(esc, str):  # "uN": N hex digits of a \u escape read
            if b not in _HEX:
                return None
            k = int(esc[1]) + 1
            return at(0, counted) if k == 4 else at(f"u{k}", count)
        if b == ord('"'):
            return self._closed(state.frames) if count >= n.min_len else None
        if b < 0x20:
            return None
        if b & 0xC0 == 0x80:  # the rest of a character already counted
            return state
        if n.max_len is not None and count >= n.max_len:
            return None
        return at("\\", count) if b == ord("\\") else at(0, counted)

    def _next_names(self, obj: int, progress: int) -> list[tuple[bytes, int]]:
        """(name, position) of the properties that may come next: from ``progress`` on, up to
        and including the first required one."""
        names = []
        for j, (name, _, required) in enumerate(self.nodes[obj].props[progress:], progress):
            names.append((name, j))
            if required:
                break
        return names

    def _in_bounded_int(self, state: JsonState, b: int) -> JsonState | None:
        """An integer with bounds, digit by digit: a prefix only where some integer it begins lies
        between them; plain digits (mode NUM) once every integer it begins does."""
        n, text = self.nodes[state.node], state.aux
        longer = text + chr(b) if b in _DIGITS or (b == ord("-") and not text) else None
        if longer is not None and not (text.endswith("0") and text in ("0", "-0")):  # no leading zeros
            room = _int_room(longer, n.low, n.high)
            if room == "all" and longer not in ("-", "0", "-0"):
                return JsonState(NUM, state.frames, state.node, "int")
            if room:
                return JsonState(BINT, state.frames, state.node, longer)
        if text in ("", "-") or not _int_in(int(text), n.low, n.high):
            return None
        return self.step(self._closed(state.frames), b)

    def _name_trie(self, obj: int, progress: Any) -> dict[bytes, tuple[frozenset[int], tuple]]:
        """The names that may come next as a trie: prefix -> (the bytes that go on from it, the
        positions of the properties it names in full). A union's objects (``progress``: the
        (object, position) pairs still possible): their names together, tagged (object, position)."""
        key = (obj, progress)
        if key not in self._names:
            if self.nodes[obj].kind == "union":
                words = [(name, (a, j)) for a, p in progress for name, j in self._next_names(a, p)]
            else:
                words = self._next_names(obj, progress)
            self._names[key] = _trie(words)
        return self._names[key]

    def _between_objects(self, state: JsonState, top: int, live: tuple, b: int) -> JsonState | None:
        """Byte ``b`` between tokens in an object that is one of a union's objects (``live``:
        the (object, position) pairs still possible)."""
        mode, frames = state.mode, state.frames
        if b == ord("}") and mode in (FIRST_KEY, AFTER) and any(self._may_close(a, p) for a, p in live):
            return self._closed(frames[:-1])
        left = tuple((a, p) for a, p in live if p < len(self.nodes[a].props))  # with keys to come
        if not left or b != ord("," if mode == AFTER else '"'):
            return None
        return JsonState(
            KEY if mode == AFTER else PKEY, (*frames[:-1], (top, left)), -1, 0 if mode == AFTER else b""
        )

    def _takes(self, obj: int, j: int, text: bytes) -> bool:
        value = self.nodes[self.nodes[obj].props[j][1]]
        return value.kind != "literals" or text in value.literals

    def _may_close(self, obj: int, progress: int) -> bool:
        return not any(required for _, _, required in self.nodes[obj].props[progress:])

    def _in_name(self, state: JsonState, b: int) -> JsonState | None:
        top, progress = state.frames[-1]
        more, tags = self._name_trie(top, progress)[state.aux]
        if b in more:  # before the quote: a name's escaped quote goes on (a name ends on no odd backslash)
            return JsonState(PKEY, state.frames, -1, state.aux + bytes([b]))
        if b != ord('"') or not tags:
            return None
        n = self.nodes[top]
        if n.kind != "union":
            j = tags[0]
            return JsonState(COLON, (*state.frames[:-1], (top, j + 1)), n.props[j][1], 0)
        # the objects that have this property next; its schema is theirs, or their enums merged
        values = {self.nodes[a].props[j][1] for a, j in tags}
        value = values.pop() if len(values) == 1 else dict(n.merged).get(state.aux)
        if value is None:  # json_schema's checks leave no such name; refused rather than guessed
            return None
        return JsonState(COLON, (*state.frames[:-1], (top, tuple((a, j + 1) for a, j in tags))), value, 0)

    def _in_literal(self, state: JsonState, b: int) -> JsonState | None:
        trie = self._lits[state.node]
        more, complete = trie[state.aux]
        if b in more:
            prefix = state.aux + bytes([b])
            if trie[prefix][1] and not trie[prefix][0]:  # complete, and nothing goes on from it
                return self._closed(state.frames, prefix)
            return JsonState(LIT, state.frames, state.node, prefix)
        return self.step(self._closed(state.frames, state.aux), b) if complete else None


def _int_in(v: int, low: int | None, high: int | None) -> bool:
    return (low is None or v >= low) and (high is None or v <= high)


def _int_room(text: str, low: int | None, high: int | None) -> str:
    """For the start of an integer's text: "all" where every integer it begins lies in [low,
    high], "some" where one does, "" where none does."""
    neg, digits = text.startswith("-"), text.lstrip("-")
    lo, hi = -math.inf if low is None else low, math.inf if high is None else high
    if not digits:  # just the sign: any negative integer
        return "some" if lo <= -1 and hi >= lo else ""
    if digits == "0":  # zero, and nothing after it
        return "some" if lo <= 0 <= hi else ""
    v = int(digits)
    some, every = False, True
    for k in range(0, 20):  # the integers of len(digits) + k digits that begin so
        a, z = v * 10**k, (v + 1) * 10**k - 1
        a, z = (-z, -a) if neg else (a, z)
        some |= a <= hi and z >= lo
        every &= lo <= a and z <= hi
        if (not neg and a > hi) or (neg and z < lo):
            break  # longer ones lie further out
    else:
        every = every and (hi == math.inf if not neg else lo == -math.inf)
    return "all" if some and every else "some" if some else ""


def _trie(words) -> dict[bytes, tuple[frozenset[int], tuple]]:
    """(word, tag) pairs -> {prefix: (the bytes that go on from it, the tags of the words it
    completes: () where none)}; the empty prefix included."""
    nexts: dict[bytes, set[int]] = {b"": set()}
    tags: dict[bytes, list] = {}
    for word, tag in words:
        tags.setdefault(word, []).append(tag)
        for i in range(len(word)):
            nexts.setdefault(word[:i], set()).add(word[i])
            nexts.setdefault(word[: i + 1], set())
    return {p: (frozenset(n), tuple(tags.get(p, ()))) for p, n in nexts.items()}


class JsonGrammar:
    """A model's tokens under one schema (default: any object, JSON mode), with its masks."""

    def __init__(self, table: TokenTable, schema: Schema = OBJECT) -> None:
        self.table, self.machine = table, JsonMachine(schema)
        self._cache: OrderedDict[JsonState, torch.Tensor] = OrderedDict()
        self._keep = max(32, CACHE_BYTES // table.vocab_size)  # masks kept
        self._dfas: dict[Pattern, torch.Tensor] = {}  # a pattern's moves, for walking tokens at once
        self._only: OrderedDict[JsonState, int | None] = OrderedDict()  # only_byte's answers

    def start(self) -> JsonState:
        return self.machine.start()

    def advance(self, state: JsonState, tokens: Sequence[int]) -> JsonState:
        """The state after ``tokens`` (picked from unblocked rows). EOS and tokens the state
        refuses -- a handed-over text, ``max_tokens`` cutting the value -- leave the state
        where the grammar can still say something: DONE stays DONE, a refused token leaves it
        as it was."""
        pieces = self.table.pieces
        for tok in tokens:
            piece = pieces[tok] if 0 <= tok < len(pieces) else None
            nxt = self.machine.walk(state, piece) if piece is not None else None
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
        if len(self._cache) > self._keep:
            self._cache.popitem(last=False)
        return mask

    def only_byte(self, state: JsonState) -> int | None:
        """The one byte that may come next in ``state``, whitespace aside between tokens (where
        it is always free); None where there are several or none (kept like the masks)."""
        if state in self._only:
            self._only.move_to_end(state)
            return self._only[state]
        step = self.machine.step
        taken = [b for b in self.machine.candidates(state) if step(state, b) is not None]
        self._only[state] = only = taken[0] if len(taken) == 1 else None
        if len(self._only) > 64 * self._keep:
            self._only.popitem(last=False)
        return only

    def _compute(self, state: JsonState) -> torch.Tensor:
        table, step = self.table, self.machine.step
        mask = torch.zeros(table.vocab_size, dtype=torch.bool)
        if state.mode == DONE:
            mask[table.eos_ids] = True
            return mask
        pairs = torch.zeros(257, 257, dtype=torch.bool)  # (first, second) byte pairs the state takes
        seconds: dict[JsonState, torch.Tensor] = {}  # after a first byte: [257] second bytes taken
        for b1 in range(256):
            s1 = step(state, b1)
            if s1 is None:
                continue
            if s1 not in seconds:
                seconds[s1] = torch.tensor([step(s1, b2) is not None for b2 in range(256)] + [True])
            pairs[b1] = seconds[s1]
        live = pairs.flatten()[table.pair] & table.texts  # [V]: first two bytes taken
        if state.mode in (KEY_STR, STR) and state.aux == 0:
            mask |= live & table.plain  # plain string bytes stay in the string
            live &= ~table.plain
        elif state.mode == FMT and isinstance(self.machine.nodes[state.node].fmt, Pattern):
            inside = (live & table.plain).nonzero().flatten()  # never leave the string: walked at once
            mask[inside] = self._pattern_walk(self.machine.nodes[state.node].fmt, state.aux, inside)
            live &= ~table.plain
        elif state.mode == BSTR and state.aux[0] == 0:  # they fit where the string has room for them
            limit = self.machine.nodes[state.node].max_len
            fits = table.plain if limit is None else table.plain & (table.chars <= limit - state.aux[1])
            mask |= live & fits
            live &= ~table.plain
        walk, pieces = self.machine.walk, table.pieces
        for i in live.nonzero().flatten().tolist():
            if walk(state, pieces[i]) is not None:
                mask[i] = True
        return mask

    def _pattern_walk(self, pattern: Pattern, at: int, tokens: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of ``tokens`` (plain string bytes) ``pattern`` takes from state ``at``,
        all walked together through its moves (the same answers as walking each)."""
        moves = self._dfas.get(pattern)
        if moves is None:  # [S + 1, 257]: row S is the dead state, column 256 the padding (stay)
            rows = torch.tensor(pattern.rows, dtype=torch.long)
            dead = rows.shape[0]
            moves = torch.full((dead + 1, 257), dead, dtype=torch.long)
            moves[:dead, :256] = torch.where(rows < 0, dead, rows)
            moves[:dead, 256] = torch.arange(dead)
            self._dfas[pattern] = moves
        dead = moves.shape[0] - 1
        data = self.table.padded[tokens].long()  # [n, L]
        cur = torch.full((tokens.numel(),), at, dtype=torch.long)
        for j in range(data.shape[1]):
            cur = moves[cur, data[:, j]]
        return cur != dead

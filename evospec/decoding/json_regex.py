"""A JSON schema's ``pattern``: a regular expression compiled into a byte automaton over the
string's JSON text.

Owns: :class:`Pattern` (``start`` / ``step`` / ``done``, as ``json_formats.py``'s formats) and
:func:`compile_pattern` (the expression -> a :class:`Pattern`, or ``ValueError`` naming what is
not supported). The expression is parsed into a Thompson automaton, made deterministic over
bytes, and trimmed to the states from which the string can still end: every text the grammar
lets through matches, and no value can be started that cannot be finished.

JSON Schema's patterns are ECMA-262 and search anywhere in the string: an expression without
``^`` / ``$`` matches anywhere (it is wrapped in ``.*``). Supported: literals (non-ASCII ones
as their UTF-8 bytes), ``.``, classes ``[...]`` / ``[^...]`` with ranges, ``\\d \\w \\s`` and
their negations, escaped metacharacters, groups ``(...)`` / ``(?:...)``, ``|``, ``* + ?`` and
``{n}`` / ``{n,}`` / ``{n,m}`` (lazy forms taken as greedy: the language is the same), ``^`` at
the start and ``$`` at the end. A character JSON writes escaped (``"``, ``\\``, control
characters) is never generated, and ``.``, negated classes and ``\\D \\W \\S`` stand for the
printable ASCII characters: a sound subset of the pattern's strings. Backreferences, lookaround,
word boundaries and non-ASCII classes are refused. Knows bytes only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

MAX_STATES = 1024  # deterministic states of one pattern
MAX_NFA = 20_000  # states of its Thompson automaton (nested counts multiply)
MAX_WORK = 5_000_000  # automaton moves and bytes followed while determinising (~0.5 s here): a schema is
# compiled while its request is read, and a pattern must not hold the server up for seconds
MAX_REPEAT = 256  # the largest count in {n,m}
MAX_SOURCE = 1000  # characters of one expression
_PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\")}  # written as they are in JSON
_DIGIT = frozenset(range(ord("0"), ord("9") + 1))
_WORD = (
    _DIGIT | frozenset(range(ord("a"), ord("z") + 1)) | frozenset(range(ord("A"), ord("Z") + 1)) | {ord("_")}
)
_SPACE = frozenset({ord(" ")})  # tabs and newlines are escaped in JSON: left out
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_META = set("\\.^$|?*+()[]{}/-")


@dataclass(frozen=True)
class Pattern:
    """A pattern's deterministic automaton over a string's bytes (equal by its source)."""

    source: str
    rows: tuple[tuple[int, ...], ...] = field(compare=False, repr=False)  # [state][byte] -> next, -1: none
    accept: frozenset[int] = field(compare=False, repr=False)

    def start(self) -> int:
        return 0

    def step(self, at: int, b: int) -> int | None:
        nxt = self.rows[at][b]
        return None if nxt < 0 else nxt

    def done(self, at: int) -> bool:
        return at in self.accept


class _Nfa:
    """Thompson automaton: ``edges[s]`` is a list of (byte set or None for an empty move, target)."""

    def __init__(self) -> None:
        self.edges: list[list[tuple[frozenset[int] | None, int]]] = []

    def state(self) -> int:
        if len(self.edges) >= MAX_NFA:
            raise ValueError(f"the pattern is too large (more than {MAX_NFA} automaton states)")
        self.edges.append([])
        return len(self.edges) - 1

    def piece(self, chars: frozenset[int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.edges[a].append((chars, b))
        return a, b

    def empty(self) -> tuple[int, int]:
        a, b = self.state(), self.state()
        self.edges[a].append((None, b))
        return a, b

    def concat(self, parts: list[tuple[int, int]]) -> tuple[int, int]:
        if not parts:
            return self.empty()
        for (_, end), (start, _) in itertools.pairwise(parts):
            self.edges[end].append((None, start))
        return parts[0][0], parts[-1][1]

    def alternate(self, parts: list[tuple[int, int]]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        for start, end in parts:
            self.edges[a].append((None, start))
            self.edges[end].append((None, b))
        return a, b

    def star(self, part: tuple[int, int]) -> tuple[int, int]:
        a, b = self.state(), self.state()
        start, end = part
        self.edges[a] += [(None, start), (None, b)]
        self.edges[end] += [(None, start), (None, b)]
        return a, b


class _Parser:
    """Recursive descent over the expression; each rule returns a fragment builder, so that a
    quantifier can instantiate its operand as many times as it needs."""

    def __init__(self, body: str, source: str) -> None:
        self.src, self.i, self.source = body, 0, source
        self.branches = 1

    def error(self, what: str) -> ValueError:
        return ValueError(f"pattern {self.source[:60]!r}: {what}")

    def peek(self) -> str | None:
        return self.src[self.i] if self.i < len(self.src) else None

    def take(self) -> str:
        ch = self.src[self.i]
        self.i += 1
        return ch

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence())
        self.branches = len(branches)  # the last alternation read: the whole expression's, at the end

        def build(nfa: _Nfa) -> tuple[int, int]:
            return nfa.alternate([b(nfa) for b in branches]) if len(branches) > 1 else branches[0](nfa)

        return build

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() in "^$":
                raise self.error("^ and $ are supported only at the start and the end")
            items.append(self.repeat(self.atom()))
        return lambda nfa: nfa.concat([item(nfa) for item in items])

    def repeat(self, atom):
        while self.peek() in ("*", "+", "?", "{"):
            lo, hi = self.quantifier()
            if self.peek() == "?":  # lazy: the same strings
                self.take()
            atom = _repeated(atom, lo, hi)
        return atom

    def quantifier(self) -> tuple[int, int | None]:
        ch = self.take()
        if ch != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        end = self.src.find("}", self.i)
        body = self.src[self.i : end] if end >= 0 else ""
        lo, _, hi = body.partition(",")
        if end < 0 or not lo.isdigit() or (hi and not hi.isdigit()):
            raise self.error("a {n,m} count must be digits")
        self.i = end + 1
        low = int(lo)
        high = low if "," not in body else (int(hi) if hi else None)
        if max(low, high or 0) > MAX_REPEAT or (high is not None and high < low):
            raise self.error(f"counts go up to {MAX_REPEAT}, with n <= m")
        return low, high

    def atom(self):
        ch = self.take()
        if ch == "(":
            if self.src.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.error("lookaround and named groups are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.error("a group is not closed")
            self.take()
            return inner
        if ch == "[":
            chars = self.bracket()
        elif ch == ".":
            chars = _PRINTABLE
        elif ch == "\\":
            chars = self.escape()
        elif ch in "*+?{":
            raise self.error(f"{ch!r} has nothing to repeat")
        elif ch == ")":
            raise self.error("')' without '('")
        else:
            return _literal(ch)
        return lambda nfa: nfa.piece(chars)

    def escape(self) -> frozenset[int]:
        if self.peek() is None:
            raise self.error("a trailing backslash")
        ch = self.take()
        if ch.lower() in _CLASSES:
            chars = _CLASSES[ch.lower()]
            return _PRINTABLE - chars if ch.isupper() else chars & _PRINTABLE
        if ch in _META or (ch.isascii() and not ch.isalnum() and ch != "_"):  # an identity escape
            return frozenset({ord(ch)}) & _PRINTABLE
        if ch == "u":
            code = self.src[self.i : self.i + 4]
            if len(code) < 4 or any(c not in "0123456789abcdefABCDEF" for c in code):
                raise self.error("\\u needs four hex digits")
            self.i += 4
            if int(code, 16) > 0x7F:
                raise self.error("\\u escapes above ASCII are not supported")
            return frozenset({int(code, 16)}) & _PRINTABLE
        if ch in "tnrfv0":
            return frozenset()  # control characters: JSON escapes them; never generated
        raise self.error(f"the escape \\{ch} is not supported")

    def bracket(self) -> frozenset[int]:
        negate = self.peek() == "^"
        if negate:
            self.take()
        chars: set[int] = set()
        first = True
        while True:
            if self.peek() is None:
                raise self.error("a class is not closed")
            ch = self.take()
            if ch == "]" and not first:
                break
            first = False
            if ch == "\\":
                chars |= self.escape()
                continue
            if self.peek() == "-" and self.src[self.i + 1 : self.i + 2] not in ("]", ""):
                self.take()
                end = self.take()
                if end == "\\":
                    raise self.error("a range must end in a plain character")
                if ord(end) < ord(ch):
                    raise self.error(f"the range {ch}-{end} runs backwards")
                chars |= set(range(ord(ch), ord(end) + 1))
            else:
                chars.add(ord(ch))
        if any(c > 0x7F for c in chars):
            raise self.error("classes of non-ASCII characters are not supported")
        return _PRINTABLE - chars if negate else frozenset(chars) & _PRINTABLE


def _literal(ch: str):
    data = ch.encode()
    if len(data) == 1:
        chars = frozenset(data) & _PRINTABLE
        return lambda nfa: nfa.piece(chars)
    return lambda nfa: nfa.concat([nfa.piece(frozenset({b})) for b in data])  # UTF-8 bytes in order


def _repeated(atom, lo: int, hi: int | None):
    def build(nfa: _Nfa) -> tuple[int, int]:
        parts = [atom(nfa) for _ in range(lo)]
        if hi is None:
            parts.append(nfa.star(atom(nfa)))
        else:
            parts += [nfa.alternate([atom(nfa), nfa.empty()]) for _ in range(hi - lo)]
        return nfa.concat(parts)

    return build


def compile_pattern(source: str) -> Pattern:
    """``source`` (a JSON schema's ``pattern``) as a :class:`Pattern`; ValueError where it goes
    past the supported subset, matches nothing writable, or needs too many states."""
    if not isinstance(source, str) or len(source) > MAX_SOURCE:
        raise ValueError(f"a pattern must be a string of at most {MAX_SOURCE} characters")
    body, head, tail = source, source.startswith("^"), source.endswith("$") and not source.endswith("\\$")
    body = body[1:] if head else body
    body = body[:-1] if tail else body
    parser = _Parser(body, source)
    expr = parser.alternation()
    if parser.i < len(body):
        raise parser.error("')' without '('")
    if (head or tail) and parser.branches > 1:  # ^a|b$ anchors each branch on one side only
        raise parser.error("put alternatives beside ^ or $ in a group: ^(a|b)$")
    nfa = _Nfa()
    parts = [expr(nfa)]
    if not head:  # ECMA patterns search: anything may come before and after
        parts.insert(0, nfa.star(nfa.piece(_PRINTABLE)))
    if not tail:
        parts.append(nfa.star(nfa.piece(_PRINTABLE)))
    start, end = nfa.concat(parts)
    return _determinise(source, nfa, start, end)


class _Budget:
    """Moves followed so far; ValueError past :data:`MAX_WORK`."""

    def __init__(self, source: str) -> None:
        self.source, self.used = source, 0

    def spend(self, n: int) -> None:
        self.used += n
        if self.used > MAX_WORK:
            raise ValueError(f"pattern {self.source[:60]!r} is too complex to compile")


def _closure(nfa: _Nfa, states: frozenset[int], budget: _Budget) -> frozenset[int]:
    out, todo = set(states), list(states)
    while todo:
        edges = nfa.edges[todo.pop()]
        budget.spend(len(edges) + 1)
        for chars, nxt in edges:
            if chars is None and nxt not in out:
                out.add(nxt)
                todo.append(nxt)
    return frozenset(out)


def _determinise(source: str, nfa: _Nfa, start: int, end: int) -> Pattern:
    budget = _Budget(source)
    first = _closure(nfa, frozenset({start}), budget)
    index, sets, rows = {first: 0}, [first], []
    while len(rows) < len(sets):
        current = sets[len(rows)]
        moves: dict[int, set[int]] = {}
        for s in current:
            for chars, nxt in nfa.edges[s]:
                budget.spend(1 + len(chars or ()))
                for b in chars or ():
                    moves.setdefault(b, set()).add(nxt)
        row = [-1] * 256
        for b, targets in moves.items():
            target = _closure(nfa, frozenset(targets), budget)
            if target not in index:
                if len(sets) >= MAX_STATES:
                    raise ValueError(f"pattern {source[:60]!r} needs more than {MAX_STATES} states")
                index[target] = len(sets)
                sets.append(target)
            row[b] = index[target]
        rows.append(row)
    accept = {i for i, s in enumerate(sets) if end in s}
    live = set(accept)  # states from which the string can still end
    changed = True
    while changed:
        changed = False
        for i, row in enumerate(rows):
            if i not in live and any(n in live for n in row if n >= 0):
                live.add(i)
                changed = True
    if 0 not in live:
        raise ValueError(f"pattern {source[:60]!r} matches no string the grammar can write")
    trimmed = tuple(tuple(n if n in live else -1 for n in row) for row in rows)
    return Pattern(source, trimmed, frozenset(accept))

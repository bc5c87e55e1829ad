"""String formats a JSON schema may name, as small byte automata: ``date``, ``time``,
``date-time`` (RFC 3339) and ``uuid`` (and a ``pattern``'s automaton, ``json_regex.py``, behind
the same three functions); ``email``, ``hostname``, ``ipv4`` and ``uri`` as the patterns of
:data:`PATTERNS`.

Owns: :data:`FORMATS`, :data:`PATTERNS`, :func:`start`, :func:`step` and :func:`done` over a
position ``at`` --
a short tuple, so that the JSON grammar's states (``json_grammar.py``) repeat across values and
their masks are computed once: a date keeps where it is and, once its year is read, only
whether the year is a leap year; a month only the number of its days. Every text these take is
a valid value of its format (the month's days, leap years, 00-23 hours, 00-59 minutes and
seconds, offsets up to 23:59); they are the usual spellings, not every one a parser takes
(no lower-case ``t`` or ``z``, no space for ``T``, no leap second). The patterns' texts are
the usual spellings too: an address of dot-separated atoms at a host with a letters-only top
label; host labels of letters, digits and inner hyphens (their 63-byte limit is not counted); a
``uri`` with a scheme, ``://``, a host, a port of 1-9999, then path, query and fragment of
unreserved and sub-delimiter characters (no percent escapes): what Pydantic's ``EmailStr``,
``IPv4Address`` and ``AnyUrl`` / ``HttpUrl`` validate. Knows bytes only.
"""

from __future__ import annotations

FORMATS = ("date", "time", "date-time", "uuid")
_LABEL = r"[A-Za-z0-9]+(-+[A-Za-z0-9]+)*"
_HOST = rf"{_LABEL}(\.{_LABEL})*"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_PATH = r"[A-Za-z0-9._~!$&'()*+,;=:@/-]"  # RFC 3986's unreserved and sub-delimiters, ":@/"
_QUERY = r"[A-Za-z0-9._~!$&'()*+,;=:@/?-]"  # ... and "?" (a query's and a fragment's)
# formats spelled as patterns (``json_regex.py``): the schema compiles them as it compiles one
PATTERNS = {
    "email": rf"^[A-Za-z0-9_%+-]+(\.[A-Za-z0-9_%+-]+)*@{_HOST}\.[A-Za-z]{{2,}}$",
    "hostname": rf"^{_HOST}$",
    "ipv4": rf"^({_OCTET}\.){{3}}{_OCTET}$",
    "uri": rf"^[A-Za-z][A-Za-z0-9+.-]*://{_HOST}(:[1-9][0-9]{{0,3}})?(/{_PATH}*)?(\?{_QUERY}*)?(#{_QUERY}*)?$",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")
_UUID_DASHES = (8, 13, 18, 23)


def _digit(b: int, lo: int = 0, hi: int = 9) -> int | None:
    d = b - ord("0")
    return d if lo <= d <= hi else None


def _days(month: int, leap: bool) -> int:
    if month == 2:
        return 29 if leap else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _date(pos: int, e, b: int):
    """YYYY-MM-DD; ``e``: what the digits so far decide (a leap year, a month's days)."""
    if pos in (4, 7):
        return (pos + 1, e) if b == ord("-") else None
    if pos == 5:
        m1 = _digit(b, 0, 1)
        return None if m1 is None else (6, (e, m1))
    if pos == 6:
        leap, m1 = e
        m2 = _digit(b, 1 if m1 == 0 else 0, 9 if m1 == 0 else 2)
        return None if m2 is None else (7, _days(10 * m1 + m2, leap))
    if pos == 8:
        d1 = _digit(b, 0, e // 10)
        return None if d1 is None else (9, (e, d1))
    if pos == 9:
        days, d1 = e
        d2 = _digit(b, 1 if d1 == 0 else 0, 9 if 10 * d1 + 9 <= days else days - 10 * d1)
        return None if d2 is None else (10, None)
    d = _digit(b)
    if d is None or pos >= 10:
        return None
    # the year (0001-9999): leap iff y % 4 == 0 and (y % 100 != 0 or y % 400 == 0); y % 4 follows
    # from the last two digits, y % 400 from the first two's % 4 where the last two are 00
    if pos == 0:
        return 1, ((2 * d) % 4, d > 0)
    if pos == 1:
        return 2, ((e[0] + d) % 4, e[1] or d > 0)  # the first two digits % 4, a digit not 0 yet
    if pos == 2:
        return 3, (e[0], (2 * d) % 4, d == 0, e[1] or d > 0)
    century, half, zero, nonzero = e
    if not (nonzero or d):
        return None  # year 0000
    return 4, (half + d) % 4 == 0 and (not (zero and d == 0) or century == 0)


def _time(pos: int, e, b: int):
    """HH:MM:SS, then an optional fraction (1-6 digits), then an optional offset: Z or +HH:MM /
    -HH:MM. Positions 0-7 the time, 8 after the seconds, 9-10 the fraction (``e``: its digits),
    11-15 the offset, 16 done."""
    if pos in (0, 11):
        h1 = _digit(b, 0, 2)
        return None if h1 is None else (pos + 1, h1)
    if pos in (1, 12):
        return None if _digit(b, 0, 3 if e == 2 else 9) is None else (pos + 1, None)
    if pos in (2, 5, 13):
        return (pos + 1, None) if b == ord(":") else None
    if pos in (3, 6, 14):
        return None if _digit(b, 0, 5) is None else (pos + 1, None)
    if pos in (4, 7, 15):
        return None if _digit(b) is None else ((8 if pos == 7 else 16 if pos == 15 else pos + 1), None)
    if pos == 9 and _digit(b) is not None:
        return 10, 1
    if pos == 10 and _digit(b) is not None:
        return (10, e + 1) if e < 6 else None  # a fraction of up to 6 digits
    if pos in (8, 10):
        if b == ord(".") and pos == 8:
            return 9, None
        if b == ord("Z"):
            return 16, None
        return (11, None) if b in b"+-" else None
    return None


def start(fmt):
    """Where a value of ``fmt`` (a format's name, or a ``json_regex.Pattern``) starts."""
    if not isinstance(fmt, str):
        return fmt.start()
    return ("t", 0, None) if fmt == "time" else ("d", 0, None)


def step(fmt, at, b: int):
    """The position after byte ``b`` at ``at``; None where ``b`` cannot follow."""
    if not isinstance(fmt, str):
        return fmt.step(at, b)
    part, pos, e = at
    if fmt == "uuid":
        if pos >= 36 or (b == ord("-")) != (pos in _UUID_DASHES) or (b != ord("-") and b not in _HEX):
            return None
        return ("d", pos + 1, None)
    if part == "d":
        if pos == 10 and fmt == "date-time":
            return ("t", 0, None) if b == ord("T") else None
        nxt = _date(pos, e, b)
    else:
        nxt = _time(pos, e, b)
    return None if nxt is None else (part, *nxt)


def done(fmt, at) -> bool:
    """Whether the text at ``at`` is a whole value of ``fmt``."""
    if not isinstance(fmt, str):
        return fmt.done(at)
    part, pos, _ = at
    if fmt == "uuid":
        return pos == 36
    if fmt == "date":
        return pos == 10
    return part == "t" and pos in (8, 10, 16)

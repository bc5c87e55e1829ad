"""A chosen tool call read as it is generated: the answer's JSON envelope -> a call or a reply.

Where the model chooses (``tool_choice`` ``"auto"``, or ``"required"`` with several tools), its
answer is one JSON object the grammar holds it to (``tools.ToolPlan.schema``):
``{"name": NAME, "arguments": {...}}`` calls NAME, ``{"response": "..."}`` answers in text.

Owns: :class:`EnvelopeReader`, fed the answer's text as it comes (:meth:`EnvelopeReader.feed`),
reporting what became known in a :class:`Delta` -- the call's name once its string closes, then
the arguments' JSON text as written, or the reply's characters decoded (escapes resolved, a
surrogate pair kept whole) -- so a stream sends each as a delta and a whole answer is read by the
same code. The grammar guarantees the shape (properties in that order, whitespace between
tokens); a text cut short (``length``) leaves what was read so far.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_KEY = re.compile(r'\s*\{\s*"(name|response)"\s*:\s*')  # the envelope's first key
_NAME = re.compile(r'\s*("(?:[^"\\]|\\.)*")')  # the called function's name, a JSON string
_ARGS_KEY = re.compile(r'\s*,\s*"arguments"\s*:')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass
class Delta:
    """What one :meth:`EnvelopeReader.feed` made known."""

    kind: str | None = None  # "call" or "reply", the one time it becomes known
    name: str | None = None  # the call's name, the one time it becomes known
    arguments: str = ""  # more of the call's arguments (JSON text)
    content: str = ""  # more of the reply (decoded text)


class EnvelopeReader:
    """One answer's envelope, read incrementally; ``kind`` is ``"call"`` or ``"reply"`` once the
    first key is read (None before), ``name`` / ``arguments`` / ``content`` what was read."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.name: str | None = None
        self.arguments = ""
        self.content = ""
        self._pending = ""  # text not read yet (a key, the name or a separator still incomplete)
        self._stage = "key"  # key -> name -> args_key -> args -> done | key -> reply -> done
        self._value = _ValueScanner()
        self._string = _StringDecoder()

    def feed(self, text: str) -> Delta:
        out = Delta()
        self._pending += text
        while self._pending and self._stage != "done":
            if not self._step(out):
                break
        return out

    def _step(self, out: Delta) -> bool:
        """Read what the stage can from ``_pending``; False when it needs more text."""
        text = self._pending
        if self._stage == "key":
            m = _KEY.match(text)
            if m is None:
                return False
            self.kind = out.kind = "call" if m.group(1) == "name" else "reply"
            self._stage = "name" if self.kind == "call" else "reply"
            self._pending = text[m.end() :]
        elif self._stage == "name":
            m = _NAME.match(text)
            if m is None:
                return False
            self.name = out.name = json.loads(m.group(1))
            self._stage, self._pending = "args_key", text[m.end() :]
        elif self._stage == "args_key":
            m = _ARGS_KEY.match(text)
            if m is None:
                return False
            self._stage, self._pending = "args", text[m.end() :]
        elif self._stage == "args":
            if not self._value.started:  # the whitespace before the value is not part of it
                text = self._pending = text.lstrip()
                if not text:
                    return False
            used = self._value.feed(text)
            self.arguments += text[:used]
            out.arguments += text[:used]
            self._pending = text[used:]
            if self._value.closed:
                self._stage = "done"
        else:  # reply: the string value, opening quote first
            decoded, used = self._string.feed(text)
            self.content += decoded
            out.content += decoded
            self._pending = text[used:]
            if self._string.closed:
                self._stage = "done"
        return True


class _ValueScanner:
    """Where one JSON value ends in text that comes in pieces (objects, arrays, strings nest;
    a bare number or literal ends at the first character that cannot continue it)."""

    def __init__(self) -> None:
        self.closed = False
        self.started = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._bare = False  # a number, true / false / null

    def feed(self, text: str) -> int:
        """Characters of ``text`` that belong to the value (all, unless it closed inside)."""
        for i, ch in enumerate(text):
            if not self.started:
                self.started = True
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._bare = True
                continue
            if self._bare:
                if ch in ",}] \t\r\n":
                    self.closed = True
                    return i
                continue
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.closed = True
                        return i + 1
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.closed = True
                    return i + 1
        return len(text)


class _StringDecoder:
    """A JSON string literal's characters as they come: the opening quote, escapes resolved
    (one held back while incomplete, a high surrogate until its low half), the closing quote."""

    def __init__(self) -> None:
        self.closed = False
        self._opened = False
        self._escape: str | None = None  # None; "" right after a backslash; "uXXX" while reading hex
        self._high: int | None = None  # a \\uD800-\\uDBFF waiting for its low half

    def feed(self, text: str) -> tuple[str, int]:
        """(decoded characters, characters of ``text`` used: up to the closing quote)."""
        out = []
        for i, ch in enumerate(text):
            if not self._opened:  # whitespace, then the opening quote
                self._opened = ch == '"'
                continue
            if self._escape is None:
                if ch == '"':
                    self.closed = True
                    return "".join(out), i + 1
                if ch == "\\":
                    self._escape = ""
                else:
                    out.append(self._char(ord(ch)))
            elif self._escape == "" and ch != "u":
                self._escape = None
                out.append(self._char(ord(_ESCAPES.get(ch, ch))))
            else:
                self._escape += ch
                if len(self._escape) == 5:  # "u" and four hex digits
                    code, self._escape = int(self._escape[1:], 16), None
                    out.append(self._char(code))
        return "".join(out), len(text)

    def _char(self, code: int) -> str:
        """The text of one decoded code unit (a high surrogate waits for the next)."""
        if 0xD800 <= code <= 0xDBFF:
            self._high = code
            return ""
        if self._high is not None:
            high, self._high = self._high, None
            if 0xDC00 <= code <= 0xDFFF:
                return chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00))
            return "\ufffd" + chr(code)  # a lone high half
        return "\ufffd" if 0xDC00 <= code <= 0xDFFF else chr(code)

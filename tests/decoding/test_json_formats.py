"""String formats as byte automata, against Pydantic's own parsers: every value written the
usual way is taken, and every text taken is a valid value (the formats spelled as patterns: texts
walked through them at random, judged by Pydantic, the standard library or an independent rule)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import re
import uuid

import pydantic
import pytest

from evospec.decoding import json_formats
from evospec.decoding.json_grammar import JsonMachine
from evospec.decoding.json_schema import SchemaError, _format_pattern, compile_schema

PARSERS = {
    "date": pydantic.TypeAdapter(datetime.date),
    "time": pydantic.TypeAdapter(datetime.time),
    "date-time": pydantic.TypeAdapter(datetime.datetime),
    "uuid": pydantic.TypeAdapter(uuid.UUID),
}


def _takes(fmt: str, text: str) -> bool:
    at = json_formats.start(fmt)
    for b in text.encode():
        at = json_formats.step(fmt, at, b)
        if at is None:
            return False
    return json_formats.done(fmt, at)


def _values(rng: random.Random) -> dict[str, str]:
    day = datetime.date(1, 1, 1) + datetime.timedelta(days=rng.randrange(3_652_059))
    time = datetime.time(
        rng.randrange(24), rng.randrange(60), rng.randrange(60), rng.choice([0, rng.randrange(10**6)])
    )
    offset = rng.choice(["", "Z", "+05:30", "-11:00", "+23:59"])
    ident = str(uuid.UUID(int=rng.getrandbits(128)))
    return {
        "date": day.isoformat(),
        "time": time.isoformat() + offset,
        "date-time": f"{day.isoformat()}T{time.isoformat()}{offset}",
        "uuid": ident.upper() if rng.random() < 0.3 else ident,
    }


def test_values_are_taken_and_what_is_taken_parses():
    rng = random.Random(0)
    taken = dict.fromkeys(PARSERS, 0)
    for _ in range(3000):
        for fmt, text in _values(rng).items():
            assert _takes(fmt, text), (fmt, text)
            for _ in range(3):  # one character changed
                i = rng.randrange(len(text))
                changed = text[:i] + rng.choice("0123456789-:TZ.+x") + text[i + 1 :]
                if _takes(fmt, changed):
                    PARSERS[fmt].validate_python(changed)  # raises where a taken text is not valid
                    taken[fmt] += 1
    assert min(taken.values()) > 1000  # the changes that stay valid were taken


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        ("date", "2024-02-29", True),
        ("date", "2000-02-29", True),
        ("date", "2023-02-29", False),
        ("date", "1900-02-29", False),
        ("date", "0000-01-01", False),
        ("date", "2024-04-31", False),
        ("date", "2024-13-01", False),
        ("time", "23:59:59.999999", True),
        ("time", "24:00:00", False),
        ("time", "12:00:60", False),
        ("date-time", "2024-01-01T00:00:00.1234567", False),
        ("date-time", "2024-01-01", False),
        ("uuid", "123e4567-e89b-12d3-a456-42661417400", False),
    ],
)
def test_edges(fmt, text, ok):
    assert _takes(fmt, text) == ok


def _pattern_takes(fmt: str, text: str) -> bool:
    machine = JsonMachine(compile_schema({"type": "array", "items": {"type": "string", "format": fmt}}))
    return machine.walk(machine.start(), json.dumps([text]).encode()) is not None


def _random_text(pattern, rng: random.Random, printable: bytes) -> str:
    """A text ``pattern`` takes, each byte drawn among those it allows next, ended at random
    where it may end (a walk the grammar's masks could make)."""
    at, out = pattern.start(), bytearray()
    while not (pattern.done(at) and rng.random() < 0.15) and len(out) < 100:
        nxt = [b for b in printable if pattern.step(at, b) is not None]
        if not nxt:
            break
        b = rng.choice(nxt)
        at, out = pattern.step(at, b), out + bytes([b])
    return out.decode() if pattern.done(at) else ""


HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]+(?<!-)")
VALID = {  # an independent judge of each pattern format
    "uri": lambda t: bool(pydantic.TypeAdapter(pydantic.AnyUrl).validate_python(t)),
    "ipv4": lambda t: bool(ipaddress.IPv4Address(t)),
    "hostname": lambda t: all(HOST_LABEL.fullmatch(label) for label in t.split(".")),
    "email": lambda t: (
        t.count("@") == 1
        and "." in t.split("@")[1]
        and t.split("@")[1].rsplit(".", 1)[1].isalpha()
        and all(HOST_LABEL.fullmatch(label) for label in t.split("@")[1].split("."))
        and all(atom for atom in t.split("@")[0].split("."))
    ),
}


@pytest.mark.parametrize("fmt", sorted(json_formats.PATTERNS))
def test_pattern_formats_take_only_valid_values(fmt):
    pattern = _format_pattern(fmt)
    rng, printable, seen = random.Random(fmt), bytes(range(0x20, 0x7F)), set()
    for _ in range(1000):
        text = _random_text(pattern, rng, printable)
        if text:
            assert VALID[fmt](text), text
            seen.add(text)
    assert len(seen) > 50


@pytest.mark.parametrize(
    ("fmt", "text", "ok"),
    [
        ("email", "ana.lopez+news@mail.example.co.uk", True),
        ("email", "a@b", False),
        ("email", "a..b@example.com", False),
        ("email", "a@-x.com", False),
        ("uri", "https://example.com/a/b?q=1&r=two#top", True),
        ("uri", "http://localhost:8080", True),
        ("uri", "example.com", False),
        ("uri", "http://a b", False),
        ("uri", "http://x:0", False),
        ("ipv4", "192.168.0.1", True),
        ("ipv4", "256.1.1.1", False),
        ("ipv4", "01.2.3.4", False),
        ("hostname", "api-2.example", True),
        ("hostname", "a-.b", False),
    ],
)
def test_pattern_format_edges(fmt, text, ok):
    assert _pattern_takes(fmt, text) == ok


def test_an_unknown_format_names_the_supported_ones():
    with pytest.raises(SchemaError, match="email, hostname, ipv4, uri"):
        compile_schema({"type": "string", "format": "credit-card"})


def test_pydantic_models_with_urls_and_addresses_compile_and_check_their_values():
    class Site(pydantic.BaseModel):
        url: pydantic.AnyUrl  # format uri with minLength 1
        ip: ipaddress.IPv4Address
        host: str = pydantic.Field(json_schema_extra={"format": "hostname"})

    machine = JsonMachine(compile_schema(Site.model_json_schema()))
    good = Site(url="https://example.com/a?b=1", ip="10.0.0.1", host="db-1.internal")
    assert machine.walk(machine.start(), good.model_dump_json().encode()) is not None
    bad = good.model_dump_json().replace("10.0.0.1", "10.0.0.300")
    assert machine.walk(machine.start(), bad.encode()) is None
    with pytest.raises(SchemaError, match="maxLength"):  # HttpUrl's 2083: refused, not unchecked
        compile_schema({"type": "string", "format": "uri", "maxLength": 2083})

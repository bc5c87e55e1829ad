"""String formats as byte automata, against Pydantic's own parsers: every value written the
usual way is taken, and every text taken is a valid value."""

from __future__ import annotations

import datetime
import random
import uuid

import pydantic
import pytest

from evospec.decoding import json_formats

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

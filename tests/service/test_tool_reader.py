"""The envelope of a chosen tool call read as it comes: whatever pieces the text arrives in, the
reader reports the call's name once, then the arguments exactly as written, or the reply's text
exactly as JSON decodes it."""

from __future__ import annotations

import json
import random

import pytest

from service.tool_reader import EnvelopeReader

CALLS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "x": [1, {"a": "}]\\\\"}], "n": null}}',
    '{ "name" :"get_date" ,\n "arguments":{} }',
    '{"name": "f", "arguments": 12 }',
    '{"name": "f", "arguments": "s}"}',
    '{"name": "q\\"uote", "arguments": [true, false]}',
]
REPLIES = [
    '{"response": "Hi \\"you\\"\\n\\t\\u00e9 \\ud83d\\ude00 \\/ end"}',
    '{ "response" :  ""}',
    '{"response": "\\\\"}',
    '{"response": "a lone half \\udc00 and \\ud800\\u0041"}',
]


def _read(text: str, pieces: int, rng: random.Random) -> tuple[EnvelopeReader, str | None, str, str]:
    """Feed ``text`` in ``pieces`` random pieces: (reader, name, arguments, content) as reported."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, pieces - 1)))
    reader, name, arguments, content, kinds = EnvelopeReader(), None, "", "", []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        known = reader.feed(text[a:b])
        kinds += [known.kind] if known.kind is not None else []
        if known.name is not None:
            assert name is None, "the name is reported once"
            name = known.name
        arguments += known.arguments
        content += known.content
    assert kinds == [reader.kind], "the kind is reported once"
    return reader, name, arguments, content


@pytest.mark.parametrize("text", CALLS)
def test_a_call_reports_its_name_once_then_its_arguments_as_written(text):
    rng = random.Random(0)
    want = json.loads(text)
    for pieces in [1, 2, 3, 5, 8, len(text)] * 20:
        reader, name, arguments, content = _read(text, pieces, rng)
        assert reader.kind == "call" and name == reader.name == want["name"]
        assert arguments == reader.arguments and json.loads(arguments) == want["arguments"]
        assert arguments == arguments.strip() and content == ""


@pytest.mark.parametrize("text", REPLIES)
def test_a_reply_reports_its_text_decoded_whatever_the_pieces(text):
    rng = random.Random(1)
    want = json.loads(text)["response"]
    if "\\udc00" in text:  # lone surrogate halves become U+FFFD: the text stays valid UTF-8
        want = want.replace("\udc00", "\ufffd").replace("\ud800", "\ufffd")
    for pieces in [1, 2, 3, 5, 8, len(text)] * 20:
        reader, name, arguments, content = _read(text, pieces, rng)
        assert reader.kind == "reply" and name is None and arguments == ""
        assert content == reader.content == want
        content.encode()  # no lone surrogate


def test_a_text_cut_short_leaves_what_was_read():
    text = CALLS[0]
    for end in range(len(text)):
        reader = EnvelopeReader()
        reader.feed(text[:end])
        if reader.name is not None:
            assert text.index('"get_weather"') < end
            assert (
                text[text.index('"arguments":') + len('"arguments":') :].strip().startswith(reader.arguments)
            )
    reply = REPLIES[0]
    full = json.loads(reply)["response"]
    for end in range(len(reply)):
        reader = EnvelopeReader()
        reader.feed(reply[:end])
        assert full.startswith(reader.content)
    kinds = [EnvelopeReader() for _ in range(2)]
    kinds[0].feed('{"na')
    kinds[1].feed('{"response":')
    assert kinds[0].kind is None and kinds[1].kind == "reply"


def test_nothing_after_the_envelope_closes_is_read():
    reader = EnvelopeReader()
    known = reader.feed('{"name": "f", "arguments": {"a": 1}}  \n')
    assert known.arguments == '{"a": 1}'
    assert reader.feed('{"a": 2} ').arguments == ""

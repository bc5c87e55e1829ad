"""The JSON grammar byte by byte (against Python's own parser) and its token masks (against
walking every token's bytes)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from evospec.decoding.json_grammar import DONE, MAX_DEPTH, MAX_WS, STR, JsonGrammar, JsonMachine, TokenTable
from evospec.decoding.json_schema import OBJECT

MACHINE = JsonMachine(OBJECT)


def walk(data: bytes, state=None):
    """The JSON-mode state after ``data`` (from the start, or from ``state``)."""
    return MACHINE.walk(MACHINE.start() if state is None else state, data)


VALID = [
    "{}",
    ' { "a" : 1 } ',
    '{"a": [1, -2.5e+3, 0, 0.0, 1E9, -0.5e-2], "b": {"c": null, "d": [true, false, []]}}',
    '{"s": "tab\\t quote\\" slash\\/ back\\\\ u\\u00e9\\uD83D\\uDE00 ünï"}',
    '{\n  "k": [\n    {"x": "y"},\n    {}\n  ]\n}',
    '{"": ""}',
    '{"a": [' * 7 + "1" + "]}" * 7,
    '{"a": ' * (MAX_DEPTH - 1) + "{}" + "}" * (MAX_DEPTH - 1),  # as deep as containers go
]
INVALID = [
    "[]",  # JSON mode's top level is an object
    '"s"',
    "1",
    "{,}",
    '{"a": 1,}',
    '{"a" 1}',
    "{a: 1}",
    '{"a": 01}',
    '{"a": .5}',
    '{"a": 1.}',
    '{"a": -}',
    '{"a": 1e}',
    '{"a": tru}',
    '{"a": True}',
    '{"a": NaN}',
    '{"a": "\\x"}',
    '{"a": "\\u12G4"}',
    '{"a": "line\nbreak"}',
    '{"a": 1]',
    '{"a": [1}',
    "{}}",
    "{} ",  # nothing after the object: it ends the text
    "{" + " " * (MAX_WS + 1) + "}",
    '{"a": ' * MAX_DEPTH + "{}" + "}" * MAX_DEPTH,  # one container too deep
]


def _done(text: str) -> bool:
    state = walk(text.encode())
    return state is not None and state.mode == DONE


@pytest.mark.parametrize("text", VALID)
def test_json_objects_and_every_prefix_of_them_are_accepted(text):
    data = text.rstrip().encode()
    assert json.loads(data) is not None
    for i in range(len(data)):
        state = walk(data[:i])
        assert state is not None and state.mode != DONE, data[:i]
    assert _done(text.rstrip())


@pytest.mark.parametrize("text", INVALID)
def test_texts_that_are_not_one_json_object_are_refused(text):
    assert not _done(text)


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([0, -3, 17, 2.5, -1e-7, 123456789])
    if kind == 1:
        return "".join(rng.choice('ab"\\/\n\té€ ') for _ in range(rng.randrange(5)))
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return rng.random()
    if kind in (4, 5):
        return {f"k{i}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]


def _mutate(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    op = rng.randrange(3)
    char = rng.choice('{}[],:"\\ 0-.eE1tfnu\n')
    if op == 0:
        return text[:i] + char + text[i:]
    if op == 1:
        return text[:i] + text[i + 1 :]
    return text[:i] + char + text[i + 1 :]


def _json_object(text: str) -> bool:
    def no_constant(name: str):
        raise ValueError(name)  # NaN / Infinity are not JSON

    try:
        return isinstance(json.loads(text, parse_constant=no_constant), dict)
    except ValueError:
        return False


def test_the_grammar_agrees_with_pythons_parser_on_random_and_mutated_objects():
    rng = random.Random(0)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        doc = {f"k{i}": _random_value(rng) for i in range(rng.randrange(4))}
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1, 2]))
        for _ in range(rng.randrange(3)):
            text = _mutate(rng, text)
        text = text.rstrip(" \t\n\r")  # trailing whitespace: Python takes it, the grammar ends at "}"
        want = _json_object(text)
        assert _done(text) == want, text
        seen[want] += 1
    assert min(seen.values()) > 500  # both kinds were tried


PIECES: list[bytes | None] = [
    b"{", b"}", b"[", b"]", b",", b":", b'"', b" ", b"\n  ", b"0", b"1", b"2", b"-", b".", b"e",
    b"true", b"false", b"null", b'{"', b'":', b'", "', b'"}', b"a", b"b", b"key", b"\\", b"n",
    b"u", b"00e9", b"\\n", b'\\"', b"12", b"3.5", b"]}", b"}]", b"x y", b" {", b'": "', b"}}",
    b"\x01", b"t", b"ru", b"\xc3", b"\xa9", b'"a"', b"  ", b"1e-", b"ull", None, b"",
]  # fmt: skip
EOS = len(PIECES)  # ids past the pieces: EOS, then one more id that is never text
VOCAB = EOS + 2


@pytest.fixture(scope="module")
def grammar() -> JsonGrammar:
    return JsonGrammar(TokenTable(PIECES, [EOS], VOCAB))


def _states() -> list:
    out = []
    for text in VALID:
        data = text.rstrip().encode()
        out += [walk(data[:i]) for i in range(len(data) + 1)]
    return list(dict.fromkeys(out))


def test_a_mask_allows_exactly_the_tokens_whose_bytes_the_state_takes(grammar):
    states = _states()
    assert len(states) > 60 and any(s.mode == DONE for s in states) and any(s.mode == STR for s in states)
    for state in states:
        mask = grammar.allowed(state)
        assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
        want = [p is not None and p != b"" and walk(p, state) is not None for p in PIECES]
        want += [state.mode == DONE, False]
        if state.mode == DONE:
            want = [False] * len(PIECES) + [True, False]  # only EOS
        assert mask.tolist() == want, state
        assert grammar.blocked(state) is grammar.blocked(state)  # kept


def test_advance_follows_picked_tokens_and_leaves_the_state_where_a_token_does_not_fit(grammar):
    ids = [PIECES.index(p) for p in (b'{"', b"key", b'": "', b"x y", b'"}')]
    state = grammar.advance(grammar.start(), ids)
    assert state.mode == DONE
    assert grammar.advance(state, [EOS, 0]) == state  # EOS and anything else: still done
    inside = grammar.advance(grammar.start(), ids[:3])
    assert grammar.advance(inside, [PIECES.index(b"\x01")]) == inside  # a control byte does not fit
    with pytest.raises(ValueError):
        TokenTable(PIECES, [EOS], len(PIECES) - 1)
    with pytest.raises(ValueError):
        TokenTable(PIECES, [], VOCAB)  # nothing could end the text


def test_the_real_tokenizers_masks_match_walking_every_token():
    from evospec.models.registry import DEFAULT_MODEL, REGISTRY, ensure_converted
    from evospec.tokenizer import TextCodec

    codec = TextCodec.from_folder(ensure_converted(REGISTRY[DEFAULT_MODEL], progress=False))
    grammar = JsonGrammar(TokenTable.for_codec(codec, codec.eos_ids, codec.vocab_size + 3))
    added = set(codec.added_ids)
    assert set(codec.eos_ids) <= added
    for text in (b"", b'{"name": "Ad', b'{"a": [1, 2', b'{"a": -1.5', b'{"a": {"b": tr', b"{}"):
        state = walk(text)
        mask = grammar.allowed(state)
        for i in range(codec.vocab_size):
            piece = codec.token_bytes(i)
            want = i not in added and walk(piece, state) is not None
            if state.mode == DONE:
                want = i in codec.eos_ids
            assert bool(mask[i]) == want, (text, i, piece)
        assert not mask[codec.vocab_size :].any()
    assert grammar.allowed(walk(b'{"a": "')).sum() > 40_000  # most tokens fit in a string

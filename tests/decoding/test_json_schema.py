"""JSON schemas: compiled from what structured-output clients send (Pydantic's schemas here),
every text the grammar completes validates against the model, every valid text in the
schema's order is accepted, and what the grammar cannot honour is refused by name."""

from __future__ import annotations

import datetime
import json
import math
import random
import uuid as uuid_module
from enum import StrEnum
from typing import Literal

import pydantic
import pytest

from evospec.decoding.json_grammar import DONE, PKEY, JsonGrammar, JsonMachine, TokenTable
from evospec.decoding.json_schema import SchemaError, compile_schema
from tests.decoding.test_json_grammar import _mutate


class Colour(StrEnum):
    red = "red"
    green = "green"


class Address(pydantic.BaseModel):
    street: str
    number: int | None = None


class Person(pydantic.BaseModel):
    name: str
    age: int
    height: float
    alive: bool
    colour: Colour
    kind: Literal["cat", "dog", 7]
    tags: list[str] = pydantic.Field(max_length=3)
    home: Address
    past: list[Address] = []
    scores: dict[str, int] = {}
    note: str | None = None


class Tree(pydantic.BaseModel):
    label: str
    children: list[Tree] = []


def _machine(model) -> JsonMachine:
    return JsonMachine(compile_schema(model.model_json_schema()))


def _done(machine: JsonMachine, text: str) -> bool:
    state = machine.walk(machine.start(), text.encode())
    return state is not None and state.mode == DONE


def _person(rng: random.Random) -> Person:
    word = lambda: "".join(rng.choice('ab "\\é\n') for _ in range(rng.randrange(4)))  # noqa: E731
    address = lambda: Address(street=word(), number=rng.choice([None, rng.randrange(-50, 50)]))  # noqa: E731
    return Person(
        name=word(),
        age=rng.randrange(-5, 120),
        height=rng.choice([0.0, 1.5, -2e-3, 180.25]),
        alive=rng.random() < 0.5,
        colour=rng.choice(list(Colour)),
        kind=rng.choice(["cat", "dog", 7]),
        tags=[word() for _ in range(rng.randrange(4))],
        home=address(),
        past=[address() for _ in range(rng.randrange(3))],
        scores={word(): rng.randrange(9) for _ in range(rng.randrange(3))},
        note=rng.choice([None, word()]),
    )


def test_valid_instances_in_the_schemas_order_are_accepted_with_every_prefix():
    machine = _machine(Person)
    rng = random.Random(1)
    for _ in range(100):
        p = _person(rng)
        for text in (p.model_dump_json(), p.model_dump_json(indent=2), json.dumps(p.model_dump(mode="json"))):
            state = machine.start()
            for i, b in enumerate(text.encode()):  # every prefix: on the way, not done before the end
                assert state is not None and state.mode != DONE, text[:i]
                state = machine.step(state, b)
            assert state is not None and state.mode == DONE, text
    # optional properties may be left out, in order
    assert _done(machine, Person.model_validate(_person(rng)).model_dump_json(exclude={"past", "note"}))


def test_every_text_the_grammar_completes_validates_against_the_model():
    """Mutated instances: the grammar accepts only what Pydantic validates (and refuses the
    valid ones it does not generate: keys out of the schema's order)."""
    machine = _machine(Person)
    rng = random.Random(2)
    accepted = refused = 0
    for _ in range(3000):
        text = _person(rng).model_dump_json()
        for _ in range(rng.randrange(1, 3)):
            text = _mutate(rng, text)
        if _done(machine, text):
            Person.model_validate_json(text, strict=False)  # raises where the grammar let it through wrongly
            accepted += 1
        else:
            refused += 1
    assert accepted > 100 and refused > 1000


def test_recursive_schemas_and_keys_are_walked():
    machine = _machine(Tree)
    text = Tree(label="a", children=[Tree(label="b", children=[Tree(label="c")])]).model_dump_json()
    assert _done(machine, text)
    assert not _done(machine, '{"label": "a", "children": [{"children": []}]}')  # label is required
    state = machine.walk(machine.start(), b'{"lab')
    assert state.mode == PKEY and machine.walk(state, b"x") is None  # only "label" begins so


SHARED_INT = {"type": "object", "properties": {"v": {"type": "integer"}}}
SHARED_STR = {"type": "object", "properties": {"v": {"type": "string"}}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}, "lookaround"),
        ({"type": "array", "items": {"type": "string", "pattern": "x", "maxLength": 3}}, "pattern beside"),
        ({"type": "object", "properties": {"a": {"type": "number", "maximum": 3}}}, "maximum"),
        (
            {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}},
            "no integer",
        ),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": True}}}, "bound"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "ipv6"}}}, "format"),
        (
            {"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"type": "string"}]}}},
            "allOf",
        ),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "object"}, {"type": "object"}]}}},
            "free keys",
        ),
        ({"type": "array", "items": {"anyOf": [SHARED_INT, SHARED_STR]}}, "different schemas"),
        ({"type": "object", "properties": {"a": {"type": ["integer", "number"]}}}, "begin differently"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}, "Missing"),
        ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "$ref"),
        ({"type": "object", "properties": {}, "required": ["a"]}, "'a'"),
        ({"type": "string"}, "root"),
        ({"anyOf": [{"type": "object"}, {"type": "string"}]}, "root"),  # a union root: objects or arrays
        ({"type": "object", "properties": {"a": {"type": "date"}}}, "date"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "minItems"),
        ([1, 2], "JSON object"),
        (_nested(70), "nest"),
        ({"type": "object", "properties": {"a": {"enum": [float("nan")]}}}, "malformed"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": [1]}, "names no definition"),
        ({"type": "object", "properties": {"a": {"type": ["string", "thing"]}}}, "not a JSON type"),
        ({"type": "array", "minItems": True}, "minItems"),
        ({"type": "array", "items": {"enum": [str(i) * 300 for i in range(300)]}}, "too long"),
    ],
)
def test_what_the_grammar_cannot_honour_is_refused_by_name(schema, words):
    with pytest.raises(SchemaError, match=words.replace("$", r"\$")):
        compile_schema(schema)


def test_names_and_literals_among_many_are_walked_by_prefix():
    """300 optional properties and a 1,000-value enum: the names and texts that begin with what
    was written go on, a whole one may close."""
    props = {f"field_{i}": {"type": "integer"} for i in range(300)}
    schema = {
        "type": "object",
        "properties": {**props, "kind": {"enum": [f"value {i}" for i in range(1000)]}},
    }
    grammar = JsonGrammar(TokenTable([bytes([b]) for b in range(256)], [256], 257), compile_schema(schema))
    allowed = grammar.allowed(grammar.machine.walk(grammar.start(), b'{"field_2'))
    assert [chr(b) for b in range(256) if allowed[b]] == ['"', *"0123456789"]
    allowed = grammar.allowed(grammar.machine.walk(grammar.start(), b'{"field_299": 1, "kind": "value 99'))
    assert [chr(b) for b in range(256) if allowed[b]] == ['"', *"0123456789"]
    assert grammar.machine.walk(grammar.start(), b'{"field_299": 1, "field_3') is None  # in order only


def test_a_type_list_keeps_each_types_own_keywords():
    schema = {"type": ["object", "null"], "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    machine = JsonMachine(compile_schema({"type": "array", "items": schema}))
    assert _done(machine, '[{"a": 1}, null]') and not _done(machine, "[{}]")


class Bounded(pydantic.BaseModel):
    code: str = pydantic.Field(min_length=2, max_length=4)
    pair: tuple[int, str]
    rest: tuple[bool, ...]


def test_string_lengths_count_code_points_and_tuples_take_their_items_in_order():
    machine = _machine(Bounded)
    for code, ok in [("ab", True), ("a", False), ("abcd", True), ("abcde", False), ("é€𝄞", True),
                     ("\\n\\u00e9x", True), ("\\n\\u00e9xyz", False), ("", False)]:  # fmt: skip
        text = f'{{"code": "{code}", "pair": [1, "x"], "rest": [true, false, true]}}'
        assert _done(machine, text) == ok, code
        if ok:
            Bounded.model_validate_json(text)
    assert not _done(machine, '{"code": "ab", "pair": ["x", 1], "rest": []}')  # the items' order
    assert not _done(machine, '{"code": "ab", "pair": [1, "x", 2], "rest": []}')  # no third item
    assert not _done(machine, '{"code": "ab", "pair": [1], "rest": []}')
    assert _done(machine, '{"code": "ab", "pair": [1, "x"], "rest": []}')


def test_bounded_string_masks_match_walking_every_piece():
    from tests.decoding.test_json_grammar import EOS, PIECES, VOCAB

    schema = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}}
    grammar = JsonGrammar(TokenTable(PIECES, [EOS], VOCAB), compile_schema(schema))
    machine = grammar.machine
    for text in (b'["', b'["a', b'["ab', b'["abc', b'["\\', b'["a\\u00', b'["x y'):
        state = machine.walk(machine.start(), text)
        want = [p is not None and p != b"" and machine.walk(state, p) is not None for p in PIECES] + [
            False,
            False,
        ]
        assert grammar.allowed(state).tolist() == want, text


class Cat(pydantic.BaseModel):
    pet_type: Literal["cat"]
    name: str
    meows: int


class Dog(pydantic.BaseModel):
    pet_type: Literal["dog"]
    name: str
    barks: bool = True


class Lizard(pydantic.BaseModel):
    scales: int


class Owner(pydantic.BaseModel):
    pets: list[Cat | Dog | Lizard | None]
    best: Cat | Dog = pydantic.Field(discriminator="pet_type")


def test_unions_of_objects_are_told_apart_by_the_keys_and_enums_written():
    machine = _machine(Owner)
    for text, ok in [
        ('{"pets": [{"pet_type": "cat", "name": "Tom", "meows": 3}], '
         '"best": {"pet_type": "dog", "name": "Rex"}}', True),
        ('{"pets": [{"scales": 9}, null, {"pet_type": "dog", "name": "a", "barks": false}], '
         '"best": {"pet_type": "cat", "name": "x", "meows": 1}}', True),
        ('{"pets": [{"pet_type": "cat", "name": "Tom", "barks": true}], "best": {"scales": 1}}', False),
        ('{"pets": [{"pet_type": "dog", "name": "Rex", "meows": 1}], "best": {"scales": 1}}', False),
        ('{"pets": [{"pet_type": "cat", "name": "Tom"}], "best": {"scales": 1}}', False),  # meows required
        ('{"pets": [{"pet_type": "bird", "name": "Tweety"}], "best": {"scales": 1}}', False),
        ('{"pets": [], "best": {"scales": 1}}', False),  # best is a cat or a dog
        ('{"pets": [{"scales": 1, "name": "x"}], "best": {"pet_type": "dog", "name": "R"}}', False),
    ]:  # fmt: skip
        assert _done(machine, text) == ok, text
        if ok:
            Owner.model_validate_json(text)
    rng = random.Random(3)
    accepted = 0
    for _ in range(1500):  # what the grammar completes validates
        kinds = [
            Cat(pet_type="cat", name="a", meows=1),
            Dog(pet_type="dog", name="b"),
            Lizard(scales=2),
            None,
        ]
        pets = [rng.choice(kinds) for _ in range(rng.randrange(3))]
        text = Owner(pets=pets, best=Dog(pet_type="dog", name="r", barks=False)).model_dump_json()
        assert _done(machine, text), text
        for _ in range(rng.randrange(1, 3)):
            text = _mutate(rng, text)
        if _done(machine, text):
            Owner.model_validate_json(text)
            accepted += 1
    assert accepted > 20


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": 1, "maximum": 9},
        {"minimum": -5, "maximum": 120},
        {"minimum": 0},
        {"maximum": -3},
        {"exclusiveMinimum": 2.5, "exclusiveMaximum": 40},
        {"minimum": -1000, "maximum": -10},
        {"minimum": 10, "maximum": 10},
    ],
)
def test_integer_bounds_take_exactly_the_integers_between_them(bounds):
    machine = JsonMachine(compile_schema({"type": "array", "items": {"type": "integer", **bounds}}))
    lo = bounds.get("minimum", math.floor(bounds.get("exclusiveMinimum", -(10**13))) + 1)
    hi = bounds.get("maximum", math.ceil(bounds.get("exclusiveMaximum", 10**13)) - 1)
    rng = random.Random(4)
    for v in [*range(-1100, 1100), *(rng.randrange(-(10**12), 10**12) for _ in range(200))]:
        assert _done(machine, f"[{v}, {v} ]") == (lo <= v <= hi), v
    for text in ("[01]", "[-]", "[1.5]", "[1e2]", "[--1]"):
        assert not _done(machine, text)


class Counted(pydantic.BaseModel):
    seats: int = pydantic.Field(ge=1, le=9)
    id: pydantic.PositiveInt
    price: pydantic.NonNegativeFloat


def test_pydantic_number_constraints_are_honoured():
    machine = _machine(Counted)
    assert _done(machine, '{"seats": 9, "id": 123456789, "price": 0.5e2}')
    for text in ('{"seats": 10, "id": 1, "price": 1}', '{"seats": 1, "id": 0, "price": 1}',
                 '{"seats": 1, "id": 1, "price": -1.5}'):  # fmt: skip
        assert not _done(machine, text), text
    with pytest.raises(SchemaError, match="minimum other than 0"):
        compile_schema({"type": "object", "properties": {"x": {"type": "number", "minimum": 1.5}}})


class Dated(pydantic.BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time
    id: uuid_module.UUID


def test_pydantic_dates_times_and_uuids_are_written_as_their_formats():
    machine = _machine(Dated)
    value = Dated(
        when=datetime.datetime(2024, 2, 29, 13, 5, 9, 120000, tzinfo=datetime.UTC),
        day=datetime.date(1999, 12, 31),
        at=datetime.time(7, 30),
        id=uuid_module.UUID(int=12345),
    )
    assert _done(machine, value.model_dump_json())
    assert not _done(machine, value.model_dump_json().replace("1999-12-31", "1999-02-30"))
    with pytest.raises(SchemaError, match="format"):
        compile_schema({"type": "object", "properties": {"e": {"type": "string", "format": "ipv6"}}})


class Num(pydantic.BaseModel):
    kind: Literal["num"]
    value: int


class Txt(pydantic.BaseModel):
    kind: Literal["txt"]
    value: str


class Box(pydantic.BaseModel):
    item: Num | Txt = pydantic.Field(discriminator="kind")


class Coded(pydantic.BaseModel):
    code: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{2}$")
    tag: str = pydantic.Field(pattern=r"ok|fine")


def test_pydantic_patterns_are_written_as_they_match():
    """Pydantic's ``pattern`` searches the string (its regex is unanchored unless ^ / $ say so)."""
    machine = _machine(Coded)
    cases = [("ABC-12", "ok", True), ("ABC-12", "so fine!", True), ("AB-12", "ok", False),
             ("ABC-123", "ok", False), ("ABC-12", "nope", False), ("abc-12", "ok", False)]  # fmt: skip
    for code, tag, ok in cases:
        text = json.dumps({"code": code, "tag": tag})
        assert _done(machine, text) == ok, text
        if ok:
            Coded.model_validate_json(text)
        else:
            with pytest.raises(pydantic.ValidationError):
                Coded.model_validate_json(text)


def test_a_union_of_objects_may_be_the_root():
    """What a chosen tool call's envelope is (service/tools.py): each call's arguments under its
    own schema, told apart by the name before them, or a reply."""

    def call(name: str, args: dict) -> dict:
        props = {"name": {"const": name}, "arguments": args}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
    string = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    number = {"type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}
    machine = JsonMachine(compile_schema({"anyOf": [call("f", string), call("g", number), reply]}))
    for text, ok in [
        ('{"name": "f", "arguments": {"q": "x"}}', True),
        ('{"name": "g", "arguments": {"q": 3}}', True),
        ('{"response": "hello"}', True),
        ('{"name": "f", "arguments": {"q": 3}}', False),
        ('{"name": "g", "arguments": {"q": "x"}}', False),
        ('{"name": "h", "arguments": {}}', False),
        ('{"response": "x", "name": "f"}', False),
    ]:
        state = machine.walk(machine.start(), text.encode())
        assert (state is not None and state.mode == DONE) == ok, text


def test_a_discriminator_before_a_shared_name_lets_its_schemas_differ():
    machine = _machine(Box)
    assert _done(machine, '{"item": {"kind": "num", "value": 3}}')
    assert _done(machine, '{"item": {"kind": "txt", "value": "3"}}')
    assert not _done(machine, '{"item": {"kind": "num", "value": "3"}}')
    assert not _done(machine, '{"item": {"kind": "txt", "value": 3}}')
    loose = {"anyOf": [{**SHARED_INT, "required": ["v"]}, {**SHARED_STR, "required": ["v"]}]}
    with pytest.raises(SchemaError, match="no required enum before it"):
        compile_schema({"type": "array", "items": loose})


def test_array_lengths_enums_and_unions():
    schema = {
        "type": "array",
        "items": {
            "anyOf": [
                {"enum": ["x", 1, True]},
                {"type": "null"},
                {"type": "object", "additionalProperties": False},
            ]
        },
        "minItems": 1,
        "maxItems": 2,
    }
    machine = JsonMachine(compile_schema(schema))
    for text, ok in [
        ('["x"]', True), ("[1, null]", True), ("[{}, true]", True), ("[]", False), ('["x", 1, 1]', False),
        ('["y"]', False), ("[12]", False), ("[false]", False), ('[{"a": 1}]', False), ("[1 ]", True),
    ]:  # fmt: skip
        assert _done(machine, text) == ok, text


UNION_ITEMS = {
    "type": "array",
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"key": {"enum": [1]}, "a": {"type": "integer"}},
                "required": ["key", "a"],
            },
            {
                "type": "object",
                "properties": {"key": {"enum": [2]}, "b": {"type": "boolean"}},
                "required": ["key", "b"],
            },
            {"type": "null"},
        ]
    },
}


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        (
            {
                "type": "object",
                "properties": {
                    "key": {"type": "integer"},
                    "a": {"enum": ["x y", "ab"]},
                    "b": {"type": "boolean"},
                },
                "required": ["key", "a"],
            },
            b'{"key": -12, "a": "x y", "b": true}',
        ),
        (UNION_ITEMS, b'[{"key": 2, "b": true}, null, {"key": 1, "a": 0}]'),
        ({"type": "array", "items": {"type": "string", "format": "date"}}, b'["2012-01-12", "2000-02-29"]'),
        ({"type": "array", "items": {"type": "string", "pattern": "^(a|b)+[0-3]?$"}}, b'["ab", "b2", "a"]'),
        ({"type": "array", "items": {"type": "string", "pattern": "a.?1"}}, b'["xa1", "a 1ru", "truea1"]'),
    ],
    ids=["object", "union", "date", "pattern", "unanchored"],
)
def test_schema_masks_match_walking_every_piece(schema, text):
    from tests.decoding.test_json_grammar import EOS, PIECES, VOCAB

    grammar = JsonGrammar(TokenTable(PIECES, [EOS], VOCAB), compile_schema(schema))
    machine = grammar.machine
    assert _done(machine, text.decode())
    for i in range(len(text) + 1):
        state = machine.walk(machine.start(), text[:i])
        want = [p is not None and p != b"" and machine.walk(state, p) is not None for p in PIECES]
        want += [state.mode == DONE, False]
        if state.mode == DONE:
            want = [False] * len(PIECES) + [True, False]
        assert grammar.allowed(state).tolist() == want, text[:i]
    assert not _done(machine, '[{"key": 2, "a": 1}]') and not _done(machine, '[{"key": 1, "b": true}]')


def test_random_schemas_compile_or_are_refused_and_their_grammars_walk():
    """Whatever a client sends as a schema: a SchemaError, or a grammar whose states give masks
    (no other exception: the server's 400 / 500 line)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text('ab"{', max_size=3))
    types = st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null", "thing"])
    keys = ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref",
            "minItems", "maxItems", "additionalProperties", "title", "pattern", "prefixItems", "minLength",
            "maxLength"]  # fmt: skip
    schemas = st.recursive(
        st.one_of(scalars, st.fixed_dictionaries({"type": types})),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.dictionaries(st.sampled_from(keys), st.one_of(inner, types, st.just("#/$defs/a")), max_size=4),
            st.fixed_dictionaries(
                {
                    "type": st.just("object"),
                    "properties": st.dictionaries(st.text("ab", max_size=2), inner, max_size=3),
                }
            ),
        ),
        max_leaves=12,
    )
    table = TokenTable([bytes([b]) for b in range(256)] + [b'{"', b'":', b"tr"], [259], 260)
    compiled = 0

    @hypothesis.given(schema=schemas, root=st.sampled_from(["object", "array"]), data=st.binary(max_size=12))
    @hypothesis.settings(max_examples=500, deadline=None, derandomize=True)
    def check(schema, root, data):
        nonlocal compiled
        whole = (
            {"type": root, "items": schema}
            if root == "array"
            else {"type": "object", "properties": {"a": schema}}
        )
        if isinstance(schema, dict):
            whole["$defs"] = {"a": schema}
        try:
            grammar = JsonGrammar(table, compile_schema(whole))
        except SchemaError:
            return
        compiled += 1
        state = grammar.start()
        for b in b"[{" + data:
            grammar.allowed(state)
            state = grammar.machine.step(state, b) or state

    check()
    assert compiled > 40  # enough of them were grammars

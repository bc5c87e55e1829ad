"""JSON schemas compiled into the nodes the JSON grammar walks (``json_grammar.py``).

Owns: :class:`Node` (one kind of value: any, object, array, string, number, integer, a set of
literal texts, a union), :class:`Schema` (the nodes and the root) and :func:`compile_schema`
(a schema dict -> :class:`Schema`, or :class:`SchemaError` naming what is not supported).
:data:`OBJECT` is JSON mode's schema: any object.

The supported subset is what structured-output clients send (OpenAI's strict subset, Pydantic's
``model_json_schema()``): ``type`` (one or a list), ``properties`` / ``required`` (properties
are written in the schema's order, optional ones may be left out), ``additionalProperties``
(with no ``properties``: the values of free keys), ``items`` / ``prefixItems`` / ``minItems`` /
``maxItems``, ``minLength`` / ``maxLength`` (in code points; an escape is one), ``format``
``date`` / ``time`` / ``date-time`` / ``uuid`` and ``email`` / ``hostname`` / ``ipv4`` / ``uri`` (the
last four as patterns, beside an implied ``minLength`` of 1 as Pydantic's ``AnyUrl`` writes it;
``json_formats.py``), ``pattern`` (a regular
expression's subset, ``json_regex.py``), ``enum`` /
``const``, ``anyOf`` / ``oneOf`` whose alternatives begin differently (a string, a number, an
object, an array, ``true`` / ``false``, ``null``: how Pydantic writes an optional field) or are
objects with properties, told apart by the keys and enum values written (Pydantic's unions of
models, discriminated or not; a name they share has one schema, or enums, or comes after a
discriminator),
``$ref`` into ``$defs`` / ``definitions`` (recursion included), and annotations (``title``,
``description``, ...) ignored; ``minimum`` / ``maximum`` / ``exclusiveMinimum`` /
``exclusiveMaximum`` for integers, ``minimum: 0`` for numbers. Anything else -- other formats,
other bounds of numbers, ``allOf`` of several schemas, ... -- is refused rather than generated
unchecked. The root is an object or an array, or a union of them. Knows JSON only.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, replace
from typing import Any

from evospec.decoding.json_formats import FORMATS, PATTERNS
from evospec.decoding.json_regex import Pattern, compile_pattern

ANY, ANY_OBJECT, ANY_ARRAY, STRING, NUMBER, TRUE_FALSE_NULL = range(6)  # every schema's first nodes
MAX_NODES = 4096  # parts of a compiled schema
MAX_NESTING = 64  # schemas inside schemas
MAX_LITERAL_BYTES = 1 << 16  # the enums' and consts' texts, all together

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
     "readOnly", "writeOnly", "strict", "name"}
)  # fmt: skip
_KEYS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "prefixItems", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "format", "pattern"},
    "number": {"type", "minimum"},  # minimum 0 only: the sign left out
    "integer": {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "boolean": {"type"},
    "null": {"type"},
}


@functools.cache
def _format_pattern(fmt: str) -> Pattern:
    """A format spelled as a pattern (``json_formats.PATTERNS``), compiled once."""
    return compile_pattern(PATTERNS[fmt])


class SchemaError(ValueError):
    """A schema this grammar cannot honour (the message says which part and why)."""


@dataclass(frozen=True)
class Node:
    """``kind``: any, object, array, string, number, integer, literals or union.
    ``props``: an object's properties in order, (the name as a JSON string's bytes without the
    quotes, value node, required). ``extra``: an object without properties: the node of its
    free keys' values (None: it is ``{}``). ``items``, ``min_items``, ``max_items``: an array's.
    ``literals``: the JSON texts a literals node takes. ``alts``: a union's nodes."""

    kind: str
    props: tuple[tuple[bytes, int, bool], ...] = ()
    extra: int | None = None
    items: int = ANY
    min_items: int = 0
    max_items: int | None = None
    prefix: tuple[int, ...] = ()  # an array's first items' nodes, in order (then ``items``)
    min_len: int = 0  # a string's length bounds, in code points
    max_len: int | None = None
    fmt: str | Pattern = ""  # a string's format (json_formats.py) or pattern (json_regex.py)
    low: int | None = None  # an integer's bounds, inclusive; a number's low: 0 or None
    high: int | None = None
    literals: tuple[bytes, ...] = ()
    alts: tuple[int, ...] = ()
    # a union whose alternatives include several objects: those objects (told apart by the keys
    # written, see json_grammar.py), and for each name they share with different enums, the
    # literals node of all those enums' texts
    objects: tuple[int, ...] = ()
    merged: tuple[tuple[bytes, int], ...] = ()


@dataclass(frozen=True)
class Schema:
    nodes: tuple[Node, ...]
    root: int


def _base() -> list[Node]:
    return [
        Node("any"),
        Node("object", extra=ANY),
        Node("array", items=ANY),
        Node("string"),
        Node("number"),
        Node("literals", literals=(b"true", b"false", b"null")),
    ]


OBJECT = Schema(tuple(_base()), ANY_OBJECT)


def first_bytes(schema: Schema, node: int, seen: frozenset[int] = frozenset()) -> frozenset[int]:
    """The bytes a value of ``node`` can begin with."""
    n = schema.nodes[node]
    digits = frozenset(b"-0123456789")
    if n.kind == "any":
        return frozenset(b'"{[tfn') | digits
    if n.kind in ("object", "array", "string"):
        return frozenset({{"object": ord("{"), "array": ord("["), "string": ord('"')}[n.kind]})
    if n.kind in ("number", "integer"):
        return digits
    if n.kind == "literals":
        return frozenset(t[0] for t in n.literals)
    if node in seen:
        raise SchemaError("a union that contains itself")
    return frozenset().union(*(first_bytes(schema, a, seen | {node}) for a in n.alts))


class _Compiler:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes: list[Node | None] = list(_base())
        self.refs: dict[str, int] = {}
        self.ids: dict[Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.depth = 0
        self.literal_bytes = 0

    def add(self, node: Node | None) -> int:
        """The id of ``node`` (an equal node already added: its id; None reserves a slot)."""
        if node is not None and node in self.ids:
            return self.ids[node]
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema is too large (more than {MAX_NODES} parts)")
        self.nodes.append(node)
        if node is not None:
            self.ids[node] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def ref(self, ref: Any, where: str) -> int:
        if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")):
            raise SchemaError(f"{where}: only $ref to '#/$defs/NAME' or '#/definitions/NAME' is supported")
        if ref not in self.refs:
            section, name = ref[2:].split("/", 1)
            defs = self.root.get(section)
            target = defs.get(name) if isinstance(defs, dict) else None
            if not isinstance(target, dict):
                raise SchemaError(f"{where}: $ref {ref!r} names no definition")
            self.refs[ref] = slot = self.add(None)  # reserved first: a definition may refer to itself
            self.nodes[slot] = self.nodes[self.node(target, ref)]
        return self.refs[ref]

    def node(self, s: Any, where: str) -> int:
        if self.depth >= MAX_NESTING:
            raise SchemaError(f"{where}: schemas nest more than {MAX_NESTING} deep")
        self.depth += 1
        try:
            return self._node(s, where)
        finally:
            self.depth -= 1

    def _node(self, s: Any, where: str) -> int:
        if s is True or s == {}:
            return ANY
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema must be an object, got {json.dumps(s)[:40]}")
        # annotations are ignored; definitions are read through $ref from the root
        s = {k: v for k, v in s.items() if k not in _ANNOTATIONS and k not in ("$defs", "definitions")}
        if "$ref" in s:
            if len(s) > 1:
                raise SchemaError(f"{where}: $ref beside other keywords is not supported")
            return self.ref(s["$ref"], where)
        if "enum" in s or "const" in s:
            return self.literals(s, where)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in s:
                return self.union(s, key, where)
        kind = s.get("type")
        if isinstance(kind, list):
            if not kind or len(set(map(str, kind))) != len(kind):
                raise SchemaError(f"{where}: type lists need distinct names")
            if not all(k in _KEYS for k in kind):
                raise SchemaError(f"{where}: type {kind!r} names something that is not a JSON type")
            # each alternative keeps the keywords of its own type
            alts = [{key: v for key, v in s.items() if key in _KEYS[k]} | {"type": k} for k in kind]
            return self.union({"anyOf": alts}, "anyOf", where)
        if kind is None:
            if s:
                raise SchemaError(f"{where}: keywords without a type: {sorted(s)}")
            return ANY
        if kind not in _KEYS:
            raise SchemaError(f"{where}: type {kind!r} is not a JSON type")
        unknown = sorted(set(s) - _KEYS[kind])
        if unknown:
            raise SchemaError(f"{where}: JSON schema keyword {unknown[0]!r} is not supported for {kind}")
        if kind == "object":
            return self.object(s, where)
        if kind == "array":
            return self.array(s, where)
        if kind == "boolean":
            return self.add(Node("literals", literals=(b"true", b"false")))
        if kind == "null":
            return self.add(Node("literals", literals=(b"null",)))
        if kind == "string":
            return self.string(s, where)
        return self.number(s, where) if kind == "number" else self.integer(s, where)

    def number(self, s: dict[str, Any], where: str) -> int:
        if "minimum" not in s:
            return NUMBER
        if _value(s["minimum"], where) != 0:
            raise SchemaError(
                f"{where}: a number's minimum other than 0 is not supported (integers take any)"
            )
        return self.add(Node("number", low=0))

    def integer(self, s: dict[str, Any], where: str) -> int:
        lows = [math.ceil(_value(s["minimum"], where))] if "minimum" in s else []
        lows += [math.floor(_value(s["exclusiveMinimum"], where)) + 1] if "exclusiveMinimum" in s else []
        highs = [math.floor(_value(s["maximum"], where))] if "maximum" in s else []
        highs += [math.ceil(_value(s["exclusiveMaximum"], where)) - 1] if "exclusiveMaximum" in s else []
        low, high = max(lows, default=None), min(highs, default=None)
        if low is not None and high is not None and low > high:
            raise SchemaError(f"{where}: no integer lies between the bounds")
        return self.add(Node("integer", low=low, high=high))

    def object(self, s: dict[str, Any], where: str) -> int:
        props = s.get("properties") or {}
        required = s.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            raise SchemaError(f"{where}: properties must be an object and required a list")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(f"{where}: required property {missing[0]!r} is not in properties")
        extra = s.get("additionalProperties", True)
        if not props:
            if extra is False:
                return self.add(Node("object"))
            return self.add(Node("object", extra=ANY if extra is True else self.node(extra, f"{where}/*")))
        slot = self.add(None)
        names = [(json.dumps(k, ensure_ascii=False)[1:-1].encode(), k) for k in props]
        compiled = tuple((b, self.node(props[k], f"{where}/{k}"), k in required) for b, k in names)
        self.nodes[slot] = Node("object", props=compiled)
        return slot

    def array(self, s: dict[str, Any], where: str) -> int:
        lo, hi = _bounds(s, "minItems", "maxItems", where)
        prefix = s.get("prefixItems", [])
        if not isinstance(prefix, list):
            raise SchemaError(f"{where}: prefixItems must be a list of schemas")
        nodes = tuple(self.node(p, f"{where}/prefixItems/{i}") for i, p in enumerate(prefix))
        items = s.get("items", True)
        if items is False:  # nothing past the prefix
            hi = len(nodes) if hi is None else min(hi, len(nodes))
            if hi < lo:
                raise SchemaError(f"{where}: minItems is more than prefixItems allows with items false")
            items = True
        node = Node(
            "array", items=self.node(items, f"{where}/items"), min_items=lo, max_items=hi, prefix=nodes
        )
        return self.add(node)

    def string(self, s: dict[str, Any], where: str) -> int:
        lo, hi = _bounds(s, "minLength", "maxLength", where)
        if "pattern" in s:
            if "format" in s or lo or hi is not None:
                raise SchemaError(
                    f"{where}: a pattern beside a format or minLength / maxLength is not supported"
                )
            try:
                return self.add(Node("string", fmt=compile_pattern(s["pattern"])))
            except ValueError as exc:
                raise SchemaError(f"{where}: {exc}") from None
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS and fmt not in PATTERNS:
                names = ", ".join((*FORMATS, *PATTERNS))
                raise SchemaError(f"{where}: format {json.dumps(fmt)[:40]} is not supported ({names} are)")
            implied = fmt in PATTERNS and lo <= 1  # a pattern format's texts are never empty (AnyUrl's)
            if (lo and not implied) or hi is not None:
                raise SchemaError(f"{where}: a format with minLength / maxLength is not supported")
            return self.add(Node("string", fmt=_format_pattern(fmt) if fmt in PATTERNS else fmt))
        return self.add(Node("string", min_len=lo, max_len=hi)) if lo or hi is not None else STRING

    def literals(self, s: dict[str, Any], where: str) -> int:
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}: enum must be a non-empty list")
        other = sorted(set(s) - {"enum", "const", "type"})
        if other:
            raise SchemaError(f"{where}: JSON schema keyword {other[0]!r} beside enum is not supported")
        texts = tuple(
            dict.fromkeys(
                json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
                for v in values
            )
        )
        self.literal_bytes += sum(map(len, texts))
        if self.literal_bytes > MAX_LITERAL_BYTES:
            raise SchemaError(
                f"{where}: the enums and consts are too long ({MAX_LITERAL_BYTES} bytes in all at most)"
            )
        return self.add(Node("literals", literals=texts))

    def union(self, s: dict[str, Any], key: str, where: str) -> int:
        alts = s[key]
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{where}: {key} must be a non-empty list")
        if key == "allOf":
            if len(alts) != 1:
                raise SchemaError(f"{where}: allOf of several schemas is not supported")
            return self.node(alts[0], where)
        slot = self.add(None)
        self.nodes[slot] = Node(
            "union", alts=tuple(self.node(a, f"{where}/{key}/{i}") for i, a in enumerate(alts))
        )
        return slot


def _value(v: Any, where: str) -> float:
    """A numeric bound (not a bool, finite, at most 10^18 in size)."""
    if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > 1e18:
        raise SchemaError(f"{where}: a bound must be a number (at most 10^18), got {json.dumps(v)[:40]}")
    return v


def _bounds(s: dict[str, Any], low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = s.get(low, 0), s.get(high)
    if type(lo) is not int or lo < 0 or (hi is not None and (type(hi) is not int or hi < lo)):
        raise SchemaError(f"{where}: {low} / {high} must be counts with {low} <= {high}")
    return lo, hi


def _plan_union(nodes: list[Node], union: Node) -> Node:
    """``union`` checked -- its alternatives begin differently, but for objects with properties,
    which are told apart by the keys written and may share a name only with the same schema or
    with enums -- and given its objects and merged enums (new literals nodes appended)."""
    view = Schema(tuple(nodes), 0)
    objects = tuple(a for a in union.alts if ord("{") in first_bytes(view, a))
    seen: set[int] = set()
    for a in union.alts if len(objects) < 2 else [a for a in union.alts if a not in objects]:
        starts = first_bytes(view, a)
        if starts & seen:
            raise SchemaError(
                "anyOf / oneOf alternatives must begin differently (a string, a number, an object, "
                f"an array, true / false, null; objects with properties may share the '{{'); two can "
                f"begin with {chr(min(starts & seen))!r}"
            )
        seen |= starts
    if len(objects) < 2:
        return union
    values: dict[bytes, list[int]] = {}
    for a in objects:
        if nodes[a].kind != "object" or nodes[a].extra is not None:
            raise SchemaError(
                "anyOf / oneOf of several objects: each must be an object with properties "
                "(free keys cannot tell the alternatives apart)"
            )
        for name, value, _ in nodes[a].props:
            values.setdefault(name, []).append(value)
    merged = []
    for name, ids in values.items():
        if len(set(ids)) == 1:
            continue
        if not all(nodes[i].kind == "literals" for i in ids):
            _check_told_apart(nodes, objects, name)
            continue
        nodes.append(
            Node("literals", literals=tuple(dict.fromkeys(t for i in ids for t in nodes[i].literals)))
        )
        merged.append((name, len(nodes) - 1))
    return replace(union, objects=objects, merged=tuple(merged))


def _check_told_apart(nodes: list[Node], objects: tuple[int, ...], name: bytes) -> None:
    """Objects of a union may give a property ``name`` different schemas only where a required
    property before it, an enum in both, has no text in common: properties are written in order,
    so that enum's text leaves one of the two before ``name`` comes (a discriminator)."""

    def before(obj: Node) -> dict[bytes, tuple[int, bool]]:
        out = {}
        for key, value, required in obj.props:
            if key == name:
                return out
            out[key] = (value, required)
        return out

    having = [a for a in objects if any(key == name for key, _, _ in nodes[a].props)]
    for i, a in enumerate(having):
        for b in having[i + 1 :]:
            mine = dict((k, v) for k, v, _ in nodes[a].props)[name]
            theirs = dict((k, v) for k, v, _ in nodes[b].props)[name]
            if mine == theirs:
                continue
            ea, eb = before(nodes[a]), before(nodes[b])
            if not any(
                ra and rb and nodes[va].kind == nodes[vb].kind == "literals"
                and not set(nodes[va].literals) & set(nodes[vb].literals)
                for key, (va, ra) in ea.items() if key in eb
                for vb, rb in [eb[key]]
            ):  # fmt: skip
                raise SchemaError(
                    f"anyOf / oneOf objects share the property {name.decode(errors='replace')!r} with "
                    "different schemas and no required enum before it tells them apart"
                )


def compile_schema(schema: Any) -> Schema:
    """The nodes of ``schema`` (a JSON schema as parsed JSON); SchemaError where it goes past
    the supported subset."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    c = _Compiler(schema)
    try:
        root = c.node(schema, "#")
    except (TypeError, ValueError) as exc:  # a value of the wrong kind somewhere, NaN in an enum
        if isinstance(exc, SchemaError):
            raise
        raise SchemaError(f"a malformed schema: {exc}") from None
    nodes = [n if n is not None else Node("any") for n in c.nodes]
    for i in range(len(nodes)):
        if nodes[i].kind == "union":
            nodes[i] = _plan_union(nodes, nodes[i])
    if len(nodes) > MAX_NODES:
        raise SchemaError(f"the schema is too large (more than {MAX_NODES} parts)")
    out = Schema(tuple(nodes), root)
    top = out.nodes[root]
    alts = top.alts if top.kind == "union" else (root,)
    if any(out.nodes[a].kind not in ("object", "array") for a in alts):
        raise SchemaError("the schema's root must be an object or an array (or a union of them)")
    return out

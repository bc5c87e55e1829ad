"""Function calling: ``tools`` and ``tool_choice`` -> what the answer may be, and the prompt
that asks for it.

Owns: :class:`Function` (a tool's name, description and parameters), :class:`ToolPlan` (what
the answer may be, and the JSON schema it is generated under), :func:`tool_plan` (the request's
``tools`` / ``tool_choice`` -> a plan, None where the answer is plain text, 400s for what is not
supported) and :func:`with_tools` (the chat messages with the tools described to the model, and
earlier tool calls and results written as text).

Two ways to call. A ``tool_choice`` naming a function (or ``"required"`` with one tool): the
client decided, and the answer is that function's arguments, generated under its parameters'
JSON schema (``decoding/json_schema.py``), the way vLLM answers a named ``tool_choice``.
``"auto"`` (also what tools without a ``tool_choice`` mean) and ``"required"`` with several
tools: the model decides, writing one JSON object -- ``{"name": NAME, "arguments": {...}}``
calls a function, ``{"response": "..."}`` (``auto`` only) answers in text -- generated under a
schema that admits exactly those (each function's arguments under its own parameters); the
handler reads it back as a call or a reply (``tool_reader.py``). The same envelope serves every
model, whatever tool format it was trained on (llama.cpp's generic tool calls work the same way);
an answer makes at most one call.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

from service.errors import APIError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function name as OpenAI takes one
_DEF_SECTIONS = ("$defs", "definitions")  # where a schema's $ref may point (json_schema.py)
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: never rewritten


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The arguments' JSON schema (no parameters: an empty object)."""
        return self.parameters or {"type": "object", "properties": {}, "additionalProperties": False}


def _functions(tools: list[Any]) -> dict[str, Function]:
    out: dict[str, Function] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in out:
            raise APIError.bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}, with a name "
                "of letters, digits, '_' and '-' (at most 64) that no other tool has",
                param=f"tools.{i}",
            )
        params = fn.get("parameters") or {}
        description = fn.get("description") or ""
        if not isinstance(params, dict) or not isinstance(description, str):
            raise APIError.bad_request(
                f"tools[{i}].function: parameters must be a JSON schema object, description a string",
                param=f"tools.{i}",
            )
        if params.get("type", "object") != "object":  # arguments are an object: {"name": value, ...}
            raise APIError.bad_request(
                f"tools[{i}].function.parameters must describe an object (type 'object'), "
                f"got type {params.get('type')!r}",
                param=f"tools.{i}",
            )
        out[name] = Function(name, description, params)
    return out


@dataclass(frozen=True)
class ToolPlan:
    """What the answer may be: with ``named``, the arguments of ``functions[0]`` and nothing
    else; otherwise one JSON object calling one of ``functions`` -- or, with ``reply``, answering
    in text."""

    functions: tuple[Function, ...]
    named: bool
    reply: bool = False

    def schema(self) -> dict[str, Any]:
        """The JSON schema the answer is generated under. Several functions' parameters sit side
        by side in an ``anyOf``: each one's definitions move to the root under names of their own
        (``tool<i>.<section>.<name>``), and its refs follow them."""
        if self.named:
            return self.functions[0].schema()
        defs: dict[str, Any] = {}
        calls = [
            _closed_object(name={"const": fn.name}, arguments=_hoisted(fn.schema(), f"tool{i}", defs))
            for i, fn in enumerate(self.functions)
        ]
        if self.reply:
            calls.append(_closed_object(response={"type": "string"}))
        return {"anyOf": calls, "$defs": defs} if defs else {"anyOf": calls}

    def instruction(self) -> str:
        """What the system message tells the model."""
        if self.named:
            fn = self.functions[0]
            about = f": {fn.description}" if fn.description else ""
            return (
                f"Call the function `{fn.name}`{about}. Reply with its arguments only, as one JSON object "
                f"that follows this JSON schema: {json.dumps(fn.schema(), ensure_ascii=False)}"
            )
        lines = ["You can call these functions:"]
        for fn in self.functions:
            about = f": {fn.description}" if fn.description else ""
            lines.append(f"- `{fn.name}`{about} Arguments: {json.dumps(fn.schema(), ensure_ascii=False)}")
        how = 'Reply with one JSON object: {"name": FUNCTION, "arguments": {...}} to call a function'
        lines.append(how + (', or {"response": TEXT} to answer without calling one.' if self.reply else "."))
        return "\n".join(lines)


def _hoisted(schema: dict[str, Any], tag: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its root's definitions moved into ``defs`` as ``<tag>.<section>.<name>``
    and every ``$ref`` to them renamed (the schema itself is not changed)."""

    def renamed(ref: str) -> str:
        for section in _DEF_SECTIONS:
            if ref.startswith(f"#/{section}/"):
                return f"#/$defs/{tag}.{section}.{ref[len(section) + 3 :]}"
        return ref

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = renamed(value)
            elif key in _DATA_KEYWORDS:
                out[key] = value
            elif key in ("properties", "patternProperties", *_DEF_SECTIONS) and isinstance(value, dict):
                # keys that are names, not keywords
                out[key] = {name: walk(sub) for name, sub in value.items()}
            else:
                out[key] = walk(value)
        return out

    moved = walk(schema)
    for section in _DEF_SECTIONS:
        table = moved.pop(section, None)
        if isinstance(table, dict):
            defs.update({f"{tag}.{section}.{name}": d for name, d in table.items()})
    return moved


def _closed_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema with exactly ``properties``, all required, in this order."""
    required = list(properties)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def tool_plan(tools: list[Any] | None, tool_choice: Any) -> ToolPlan | None:
    """What the answer may be; None where ``tool_choice`` is ``"none"`` or there are no tools
    (then the answer is text)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError.bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        return ToolPlan(tuple(functions.values()), named=False, reply=True)
    if tool_choice == "required":
        return ToolPlan(tuple(functions.values()), named=len(functions) == 1)
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if named else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise APIError.bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
            f"{{'name': NAME}}}} naming one of the tools ({', '.join(functions)})",
            param="tool_choice",
        )
    return ToolPlan((functions[name],), named=True)


def _function_of(call: Any) -> dict[str, Any]:
    """An earlier tool call's ``function`` object ({} where the call has none)."""
    fn = call.get("function") if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else {}


def _written(fn: dict[str, Any]) -> str:
    """An earlier call as the envelope writes one (its arguments as JSON where they parse; as the
    string they came in where not, or where they nest deeper than Python's JSON reads)."""
    raw = fn.get("arguments")
    if isinstance(raw, str):
        with contextlib.suppress(ValueError, RecursionError):
            return json.dumps({"name": fn.get("name"), "arguments": json.loads(raw)}, ensure_ascii=False)
    return json.dumps({"name": fn.get("name"), "arguments": raw}, ensure_ascii=False)


def with_tools(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, str]]:
    """Messages for the chat template: an assistant's earlier ``tool_calls`` written as the JSON
    of each call, a tool result as its content, and -- where the answer may call -- the plan's
    instruction joined to the system message (one is put first where there is none)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if calls:
            written = [_written(f) for f in map(_function_of, calls)]
            content = "\n".join([content, *written]) if content else "\n".join(written)
        out.append({"role": m["role"], "content": content})
    if plan is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{plan.instruction()}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": plan.instruction()})
    return out

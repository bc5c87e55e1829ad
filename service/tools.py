"""Function calling that names its function: ``tools`` with ``tool_choice`` set to one function
(or ``"required"`` with one tool), answered as a tool call whose arguments follow the function's
parameters schema.

Owns: :class:`Function` (a tool's name, description and parameters), :func:`forced_function`
(the request's ``tools`` / ``tool_choice`` -> the function the answer must call, None where no
call is asked for, 400s for what is not supported) and :func:`with_function` (the chat messages
with the function described to the model, and earlier tool calls and results written as text).
The arguments are generated under the parameters' JSON schema (``decoding/json_schema.py``), the
way vLLM answers a named ``tool_choice``: the model does not decide whether to call, the client
did. ``tool_choice: "auto"`` -- the model deciding, in a format of its own -- needs a parser
per model family and is refused rather than answered as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.errors import APIError


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
        if not isinstance(name, str) or not name or name in out:
            raise APIError.bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}, "
                "with a name no other tool has",
                param=f"tools.{i}",
            )
        params = fn.get("parameters") or {}
        description = fn.get("description") or ""
        if not isinstance(params, dict) or not isinstance(description, str):
            raise APIError.bad_request(
                f"tools[{i}].function: parameters must be a JSON schema object, description a string",
                param=f"tools.{i}",
            )
        out[name] = Function(name, description, params)
    return out


def forced_function(tools: list[Any] | None, tool_choice: Any) -> Function | None:
    """The function the answer calls; None where ``tool_choice`` is ``"none"`` or there are no
    tools (then the answer is text)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError.bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        raise APIError.unsupported(
            "tool_choice",
            "tool_choice 'auto' (the model choosing whether to call, in its own format; name the function, "
            "or use 'required' with one tool)",
        )
    if tool_choice == "required":
        if len(functions) != 1:
            raise APIError.unsupported("tool_choice", "tool_choice 'required' with several tools")
        return next(iter(functions.values()))
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    fn = tool_choice.get("function") if named else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise APIError.bad_request(
            "tool_choice must be 'none', 'required' or {'type': 'function', 'function': {'name': NAME}} "
            f"naming one of the tools ({', '.join(functions)})",
            param="tool_choice",
        )
    return functions[name]


def _function_of(call: Any) -> dict[str, Any]:
    """An earlier tool call's ``function`` object ({} where the call has none)."""
    fn = call.get("function") if isinstance(call, dict) else None
    return fn if isinstance(fn, dict) else {}


def _instruction(fn: Function) -> str:
    about = f": {fn.description}" if fn.description else ""
    return (
        f"Call the function `{fn.name}`{about}. Reply with its arguments only, as one JSON object "
        f"that follows this JSON schema: {json.dumps(fn.schema(), ensure_ascii=False)}"
    )


def with_function(messages: list[dict[str, Any]], fn: Function | None) -> list[dict[str, str]]:
    """Messages for the chat template: an assistant's earlier ``tool_calls`` written as the JSON
    of each call, a tool result as its content, and -- where ``fn`` is to be called -- the call's
    instruction joined to the system message (one is put first where there is none)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        calls = m.get("tool_calls") or []
        if calls:
            written = [
                json.dumps({"name": f.get("name"), "arguments": f.get("arguments")})
                for f in map(_function_of, calls)
            ]
            content = "\n".join([content, *written]) if content else "\n".join(written)
        out.append({"role": m["role"], "content": content})
    if fn is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{_instruction(fn)}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": _instruction(fn)})
    return out

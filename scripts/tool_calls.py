"""Function calls from the default model through the server's request path, and what they cost.

Each request in :data:`CALLS` (a question and the tool it wants, written for this: no data set
needed) goes through what ``POST /v1/chat/completions`` does: ``ChatRequest.template_messages()``
(the tools described in the system message) and ``output_schema`` (the grammar); the default
model then decodes the answer with ``ar``, with ``ngram`` and with ``ngram`` without
jump-forward guesses (``decoding/json_guess.py``; ``tree.jump_forward`` 0), in a rotating
order, ``--passes`` times. ``--choice named``: ``tool_choice: "required"`` with the question's one
tool (the answer is its arguments); ``required``: all four tools offered, the model choosing one
(a JSON envelope, read back by ``service/tool_reader.py``); ``auto``: the same, plus
:data:`REPLIES` (questions no tool answers), where the model may reply in text. Printed: each
answer (first pass), whether it closed as JSON the schema takes, whether it called the tool the
question wants (or, for :data:`REPLIES`, replied), each ngram arm's time over ar's and over the
other's (medians; the whole call, and its decoding after the prefill) with its MAL; every ngram
output is checked equal to ar's.

    .venv/bin/python scripts/tool_calls.py --passes 3 [--choice named|required|auto] [--grammars cold|warm]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from evospec.assembly import StackSettings, assemble
from evospec.decoding.json_grammar import DONE, JsonGrammar
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from service.schemas import ChatRequest
from service.tool_reader import EnvelopeReader


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


WEATHER = _tool(
    "get_weather",
    "The current weather in a city.",
    {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    ["city", "unit"],
)
FLIGHT = _tool(
    "book_flight",
    "Book a flight.",
    {"origin": {"type": "string"}, "destination": {"type": "string"}, "passengers": {"type": "integer"}},
    ["origin", "destination", "passengers"],
)
EVENT = _tool(
    "create_event",
    "Put an event in the calendar.",
    {
        "title": {"type": "string"},
        "day": {"type": "string"},
        "attendees": {"type": "array", "items": {"type": "string"}},
    },
    ["title", "day", "attendees"],
)
SEARCH = _tool(
    "search_products",
    "Search the shop.",
    {"query": {"type": "string"}, "max_price": {"type": "number"}, "in_stock": {"type": "boolean"}},
    ["query", "max_price", "in_stock"],
)
CALLS = (
    ("What is the weather in Paris today?", WEATHER),
    ("Is it cold in Oslo? Use fahrenheit.", WEATHER),
    ("Book me a flight from Madrid to Rome for two people.", FLIGHT),
    ("I need 3 seats from Boston to Chicago.", FLIGHT),
    ("Schedule a project review on Monday with Ana and Li.", EVENT),
    ("Team lunch on Friday, invite Sam, Kim and Joe.", EVENT),
    ("Find running shoes under 80 dollars that are in stock.", SEARCH),
    ("Look for a cheap desk lamp, at most 25, available now.", SEARCH),
)
REPLIES = (  # questions no tool answers: under auto, a reply is right
    ("Tell me a joke about cats.", None),
    ("What is the capital of Japan?", None),
    ("Write a haiku about the sea.", None),
    ("Who wrote Romeo and Juliet?", None),
)
TOOLS = [WEATHER, FLIGHT, EVENT, SEARCH]


# each ratio: the first arm's time over the second's, per request
RATIOS = {
    "ngram x ar": ("ar", "ngram"),
    "ngram-nojump x ar": ("ar", "ngram-nojump"),
    "ngram x ngram-nojump": ("ngram-nojump", "ngram"),
}


def _verdict(text: str, choice: str, tool: dict | None) -> str:
    """What the answer did: "called NAME" or "replied", and whether that is what was wanted."""
    if choice == "named":
        return "called " + tool["function"]["name"] + " (named)"
    reader = EnvelopeReader()
    reader.feed(text)
    did = f"called {reader.name}" if reader.kind == "call" else "replied"
    want = f"called {tool['function']['name']}" if tool is not None else "replied"
    return f"{did} ({'right' if did == want else 'wanted: ' + want})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--choice", choices=["named", "required", "auto"], default="named")
    ap.add_argument(
        "--grammars",
        choices=["cold", "warm"],
        default="cold",
        help="cold: each arm decodes with a grammar of its own, built for it (a server's first "
        "request with a schema: every mask computed as it is met); warm: the arms share one, "
        "decoded once untimed first (a server that keeps the schema's grammar, from its second "
        "request on)",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("ar", "ngram"), weights="int4"), progress=False)
    codec = stack.codec
    ngram = stack.decoder("ngram")
    # arm -> (decoder, its tree): the ngram arms share one decoder, its tree set per run
    decoders = {
        "ar": (stack.decoder("ar"), None),
        "ngram": (ngram, ngram.tree),
        "ngram-nojump": (ngram, replace(ngram.tree, jump_forward=0)),
    }
    asks = CALLS + (REPLIES if args.choice == "auto" else ())
    ratios, tokens, closed, right, mismatches = {k: [] for k in RATIOS}, 0, 0, 0, 0
    decode_ratios = {k: [] for k in RATIOS}  # the same, the prefill left out
    rounds = dict.fromkeys(decoders, 0)
    for p in range(args.passes):
        for i, (question, tool) in enumerate(asks):
            body = {"model": "m", "messages": [{"role": "user", "content": question}]}
            if args.choice == "named":
                body |= {"tools": [tool], "tool_choice": "required"}
            else:
                body |= {"tools": TOOLS, "tool_choice": args.choice}
            request = ChatRequest.model_validate(body)
            ids = codec.encode_chat(request.template_messages())

            def params_with(grammar: JsonGrammar) -> SamplingParams:
                return SamplingParams(max_new_tokens=args.max_tokens, penalties=Penalties(grammar=grammar))

            grammar = JsonGrammar(stack.json_tokens, request.output_schema[1])
            params = params_with(grammar)
            if args.grammars == "warm":  # the grammar's masks computed before any arm is timed
                list(stack.decoder("ar").generate(ids, params))
            took, decode, out = {}, {}, {}
            order = list(decoders)
            for method in order[(i + p) % 3 :] + order[: (i + p) % 3]:
                decoder, tree = decoders[method]
                if tree is not None:
                    decoder.tree = tree
                if args.grammars == "cold":
                    params = params_with(JsonGrammar(stack.json_tokens, request.output_schema[1]))
                t0 = time.perf_counter()
                events, first = [], None
                for ev in decoder.generate(ids, params):
                    events.append(ev)
                    first = first or time.perf_counter()  # the prefill's event
                took[method] = time.perf_counter() - t0
                decode[method] = t0 + took[method] - first
                out[method] = [t for ev in events for t in ev.tokens]
                rounds[method] += len(events) - 1  # the prefill's event aside
            mismatches += (out["ar"] != out["ngram"]) + (out["ar"] != out["ngram-nojump"])
            for name, (slow, fast) in RATIOS.items():
                ratios[name].append(took[slow] / took[fast])
                decode_ratios[name].append(decode[slow] / max(decode[fast], 1e-9))
            if p == 0:
                text = codec.decode(out["ar"])
                state = grammar.advance(grammar.start(), out["ar"])
                ok = state.mode == DONE and isinstance(json.loads(text), dict)
                verdict = _verdict(text, args.choice, tool)
                closed += ok
                right += "right" in verdict or args.choice == "named"
                tokens += len(out["ar"])
                flat = " ".join(text.split())
                print(f"{question!r}: {flat}  ({len(out['ar'])} tokens, closed: {ok}; {verdict})")
    per_call = tokens / len(asks)
    print(f"{closed}/{len(asks)} answers closed as JSON their schema takes; {per_call:.1f} tokens each")
    if args.choice != "named":
        print(f"{right}/{len(asks)} called the tool the question wants (or replied where none does)")
    for name, values in ratios.items():
        whole, after = statistics.median(values), statistics.median(decode_ratios[name])
        print(
            f"{name} (medians of {len(values)}): whole answer incl. prefill {whole:.3f}, decoding {after:.3f}"
        )
    decoded = rounds["ar"]  # one token a round
    for method in ("ngram", "ngram-nojump"):
        print(f"{method}: MAL {decoded / rounds[method]:.3f} ({rounds[method]} rounds)")
    print(f"ngram outputs differing from ar's: {mismatches}")


if __name__ == "__main__":
    main()

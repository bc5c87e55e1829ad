"""What JSON mode costs and gives: tokens/s, ngram's speed-up and valid JSON, free vs JSON mode.

The default model answers requests that ask for JSON (:data:`PROMPTS`, written for this: no
data set needed) with ``ar`` and ``ngram``, each free and in JSON mode (``response_format``
``json_object``: ``decoding/json_grammar.py``), the four runs of a prompt in a rotating order,
``--passes`` times. Printed per run kind: median decode tokens/s (the prefill event left out),
ngram's MAL and its median speed-up over ``ar`` in the same mode and pass, the share of answers
that parse as one JSON object (free answers also after stripping a Markdown code fence), and the
time the grammar's masks take per token (their first computation included). Every JSON-mode
ngram output is checked equal to JSON-mode ``ar``'s.

    .venv/bin/python scripts/json_mode_cost.py --passes 3 --max-tokens 96 [--jump-forward 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from evospec.assembly import StackSettings, assemble
from evospec.decoding.json_grammar import JsonGrammar
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams

PROMPTS = (
    "Give me a JSON object describing a cat named Tom: his age, colour and favourite foods.",
    "List three European capitals with their countries and populations, as JSON.",
    'Extract the people and places from this sentence as JSON: "Maria flew from Lisbon to '
    'Berlin to meet her brother Paul, and then they drove to Prague."',
    "Write a JSON configuration for a web server: host, port, TLS settings and two routes.",
    "What is 17 * 23? Answer in JSON with keys question, steps and answer.",
    "Describe the planets Mars and Venus in JSON: diameter, moons, distance from the sun.",
    "Return a JSON object with a shopping list of five items, each with a name and a quantity.",
    "Turn this into JSON: name Alan Turing, born 1912 in London, known for the Turing machine "
    "and breaking Enigma, died 1954.",
    "Give a JSON object with a recipe for pancakes: ingredients with amounts, and the steps.",
    "Summarize the plot of Romeo and Juliet as a JSON object with title, characters and events.",
    "Make a JSON object for a book: title, author, year, genres and a short description.",
    "Classify these words as JSON, by part of speech: run, blue, quickly, table, sing, happy.",
)


def parses(text: str, fenced: bool) -> bool:
    body = text.strip()
    if fenced and body.startswith("```"):
        body = body.split("\n", 1)[-1].rsplit("```", 1)[0] if "\n" in body else body
        if body.count("```"):
            body = body.split("```", 1)[0]
    try:
        return isinstance(json.loads(body), dict)
    except ValueError:
        return False


def run(stack, method: str, ids: list[int], params: SamplingParams) -> tuple[list[int], float, int]:
    """(tokens, decode seconds after the prefill event, rounds after it)."""
    tokens, decode_s, rounds, t_prev = [], 0.0, 0, None
    for ev in stack.decoder(method).generate(ids, params):
        now = time.perf_counter()
        if t_prev is not None:
            decode_s += now - t_prev
            rounds += 1
        t_prev = now
        tokens += ev.tokens
    return tokens, decode_s, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument(
        "--jump-forward",
        type=int,
        default=None,
        help="ngram's tree.jump_forward (guesses of what the grammar forces); default: its own",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("ar", "ngram"), weights="int4"), progress=False)
    if args.jump_forward is not None:
        ngram = stack.decoder("ngram")
        ngram.tree = replace(ngram.tree, jump_forward=args.jump_forward)
    codec = stack.codec
    t0 = time.perf_counter()
    grammar = JsonGrammar(stack.json_tokens)
    print(f"grammar built in {time.perf_counter() - t0:.2f} s ({codec.vocab_size} tokens)")
    masks_s = 0.0
    blocked = grammar.blocked

    def timed_blocked(state):
        nonlocal masks_s
        t = time.perf_counter()
        try:
            return blocked(state)
        finally:
            masks_s += time.perf_counter() - t

    grammar.blocked = timed_blocked
    kinds = [(m, js) for m in ("ar", "ngram") for js in (False, True)]
    rate: dict[tuple, list[float]] = {k: [] for k in kinds}
    speedup: dict[bool, list[float]] = {False: [], True: []}
    valid: dict[tuple, int] = dict.fromkeys(kinds, 0)
    tokens_rounds: dict[tuple, list[int]] = {k: [0, 0] for k in kinds}
    json_tokens, mismatches = 0, 0
    for p in range(args.passes):
        for i, text in enumerate(PROMPTS):
            ids = codec.encode_chat([{"role": "user", "content": text}])
            order = kinds[(i + p) % 4 :] + kinds[: (i + p) % 4]
            got = {}
            for method, js in order:
                pen = Penalties(grammar=grammar) if js else Penalties()
                params = SamplingParams(max_new_tokens=args.max_tokens, penalties=pen)
                got[method, js] = run(stack, method, ids, params)
            for k in kinds:
                tokens, dt, rounds = got[k]
                rate[k].append((len(tokens) - 1) / dt)
                tokens_rounds[k][0] += len(tokens) - 1
                tokens_rounds[k][1] += rounds
                if p == 0:
                    valid[k] += parses(codec.decode(tokens), fenced=not k[1])
            for js in (False, True):
                speedup[js].append(got["ar", js][1] / got["ngram", js][1])
            json_tokens += len(got["ar", True][0]) + len(got["ngram", True][0])
            mismatches += got["ar", True][0] != got["ngram", True][0]
        print(f"pass {p + 1}/{args.passes} done", flush=True)
    print("| run | decode tok/s (median) | MAL | ngram / ar (median) | answers that parse |")
    print("|---|---|---|---|---|")
    for method, js in kinds:
        toks, rounds = tokens_rounds[method, js]
        ratio = f"{statistics.median(speedup[js]):.3f}" if method == "ngram" else ""
        mode = "JSON mode" if js else "free"
        tok_s = statistics.median(rate[method, js])
        print(
            f"| {method}, {mode} | {tok_s:.1f} | {toks / rounds:.3f} | {ratio} | "
            f"{valid[method, js]}/{len(PROMPTS)} |"
        )
    per_token = masks_s * 1e6 / max(json_tokens, 1)
    print(f"masks: {per_token:.1f} us per JSON-mode token ({len(grammar._cache)} states kept)")
    print(f"JSON-mode ngram outputs differing from ar's: {mismatches}")


if __name__ == "__main__":
    main()

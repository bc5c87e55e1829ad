"""Greedy picks under a JSON grammar from a state's few allowed ids, or from a masked copy of the
whole row: whole tool-call decodes with the two swapped in one process.

``sampling.greedy_pick`` reads only the ids a structural state allows (``JsonGrammar.few_allowed``)
where the grammar is a request's only adjustment; the other arm makes ``few_allowed`` answer None,
so every pick masks the row first (what every greedy pick under a grammar did before). Decodes the
named tool calls of ``tool_calls.py`` (its questions, each with its one tool) with ``ar`` and
``ngram``, each grammar decoded once untimed first (a server keeps a schema's grammar), ``--rounds``
times, both arms per request in an order that flips from request to request; prints each method's
median decode-time ratio (masked rows over few ids) and whether the tokens are equal.

    .venv/bin/python scripts/grammar_pick_ab.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tool_calls import CALLS

from evospec.assembly import StackSettings, assemble
from evospec.decoding.json_grammar import JsonGrammar
from evospec.decoding.penalties import Penalties
from evospec.decoding.sampling import SamplingParams
from service.schemas import ChatRequest

FEW_ALLOWED = JsonGrammar.few_allowed


def decode_s(decoder, ids: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """(seconds after the prefill's event, the tokens)."""
    first, tokens = None, []
    for ev in decoder.generate(ids, params):
        first = first or time.perf_counter()
        tokens += ev.tokens
    return time.perf_counter() - first, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("ar", "ngram"), weights="int4"), progress=False)
    jobs = []
    for question, tool in CALLS:
        body = {"model": "m", "messages": [{"role": "user", "content": question}]}
        request = ChatRequest.model_validate(body | {"tools": [tool], "tool_choice": "required"})
        grammar = JsonGrammar(stack.json_tokens, request.output_schema[1])
        params = SamplingParams(max_new_tokens=args.max_tokens, penalties=Penalties(grammar=grammar))
        ids = stack.codec.encode_chat(request.template_messages())
        list(stack.decoder("ar").generate(ids, params))  # the grammar's masks, untimed
        jobs.append((ids, params))
    ratios: dict[str, list[float]] = {"ar": [], "ngram": []}
    equal = True
    for r in range(args.rounds):
        for i, (ids, params) in enumerate(jobs):
            for method in ratios:
                took, out = {}, {}
                for arm in ("few", "masked") if (i + r) % 2 else ("masked", "few"):
                    JsonGrammar.few_allowed = FEW_ALLOWED if arm == "few" else (lambda self, state: None)
                    took[arm], out[arm] = decode_s(stack.decoder(method), ids, params)
                JsonGrammar.few_allowed = FEW_ALLOWED
                equal &= out["few"] == out["masked"]
                ratios[method].append(took["masked"] / took["few"])
    for method, values in ratios.items():
        median = statistics.median(values)
        print(f"{method}: masked rows / few ids, decoding (median of {len(values)}): {median:.3f}")
    print(f"tokens equal in every pair: {equal}")


if __name__ == "__main__":
    main()

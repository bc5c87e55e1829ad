"""frspec with and without round feedback for its table, beside ngram: what a round's
vocabulary bookkeeping costs, in one process.

Builds three decoders on the default model at wave 37's tuned shapes (``ngram:3:2:1:1`` and
twice ``frspec:3:2:1:4:0.3``, in ``scripts/tree_ab.py``'s syntax); on the second frspec the
table's policy is made to observe rounds again (``observes`` True: the path's target logits
gathered and a feedback built every round, as before wave 38). Every prompt runs all three in a
rotating order; outputs must be equal. Prints per decoder its decode tok/s and the mean
milliseconds of its rounds by kind (free: lookup or table guessed; plain: nothing proposed or
the chain stopped; drafted), and the ratio of the two frspec speeds:

    .venv/bin/python scripts/feedback_ab.py --data ../shared/data/spec_bench/question.jsonl
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from tree_ab import variant_tree

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.methods import make_decoder
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams

VARIANTS = {"ngram": "ngram:3:2:1:1", "frspec": "frspec:3:2:1:4:0.3", "frspec+feedback": "frspec:3:2:1:4:0.3"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("frspec",), weights="int4"), progress=False)
    decs = {}
    for name, spec in VARIANTS.items():
        method, tree = variant_tree(spec)
        decs[name] = make_decoder(
            method, stack.loaded.model, eos_ids=stack.eos_ids, draft=stack.draft, tree=tree,
            indices=stack.indices, ngrams=stack.ngrams,
        )  # fmt: skip
    decs["frspec+feedback"].vocab.policy.observes = True  # an instance's flag over its class's
    record_steps(stack.loaded.model, decs.values())
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    names = list(decs)
    for name in names:  # warm-up
        list(decs[name].generate(prompts[0], params))
    rounds, wall, tokens = collections.defaultdict(list), collections.Counter(), collections.Counter()
    for i, ids in enumerate(prompts):
        outs = {}
        for name in names[i % 3 :] + names[: i % 3]:
            out, t0 = [], time.perf_counter()
            for ev in decs[name].generate(ids, params):
                out += ev.tokens
                if ev.prefill:
                    t0 = time.perf_counter()
                    continue
                kind = (
                    "drafted" if ev.tree_size and not ev.looked_up else ("free" if ev.tree_size else "plain")
                )
                rounds[name, kind].append(ev.round_s)
            wall[name] += time.perf_counter() - t0
            tokens[name] += len(out) - 1
            outs[name] = out
        if len(set(map(tuple, outs.values()))) != 1:
            raise SystemExit(f"outputs differ on prompt {i}")
    for name in names:
        kinds = ", ".join(
            f"{k} {1e3 * statistics.mean(rounds[name, k]):.3f} ms x{len(rounds[name, k])}"
            for k in ("free", "plain", "drafted")
            if rounds[name, k]
        )
        print(f"{name}: decode {tokens[name] / wall[name]:.1f} tok/s; rounds: {kinds}")
    speed = {n: tokens[n] / wall[n] for n in names}
    print(f"frspec / frspec+feedback: {speed['frspec'] / speed['frspec+feedback']:.3f}")


if __name__ == "__main__":
    main()

"""Weights prefetched non-temporally or not, side by side in one process (docs/benchmarks.md,
wave 40). Needs the temporary ``set_prefetch_override`` op of the commit that adds this script
(it was removed after the measurement): mode 0 prefetches every weight into every cache level
(before wave 40), -1 as each weight says (the target's streamed, a draft's kept), 1 every
weight streamed. Decodes the Spec-Bench prompts with ``ar``, ``ngram`` and frspec (the
``scripts/tree_ab.py`` variants given), each in every mode, rotated per prompt; outputs must
be equal. Prints decode tok/s per method and mode, and each mode's ratio to the first:

    .venv/bin/python scripts/prefetch_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --modes 0 -1 --per-category 3
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["ar", "ngram:3:2:1:1", "frspec:3:2:1:1"])
    ap.add_argument("--modes", nargs="+", type=int, default=[0, -1])
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("frspec",), weights="int4"), progress=False)
    model = stack.loaded.model
    decs = {}
    for spec in args.variants:
        method, tree = ("ar", None) if spec == "ar" else variant_tree(spec)
        decs[spec] = make_decoder(
            method, model, eos_ids=stack.eos_ids, draft=stack.draft, tree=tree, indices=stack.indices,
            ngrams=stack.ngrams,
        )  # fmt: skip
    record_steps(model, decs.values())
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    arms = [(n, m) for n in decs for m in args.modes]
    for n in decs:  # warm-up
        list(decs[n].generate(prompts[0], params))
    wall, toks = collections.Counter(), collections.Counter()
    ratios = collections.defaultdict(list)
    base = args.modes[0]
    for i, ids in enumerate(prompts):
        outs, speed = {}, {}
        for n, m in arms[i % len(arms) :] + arms[: i % len(arms)]:
            torch.ops.evospec.set_prefetch_override(m)
            out, t0 = [], time.perf_counter()
            for ev in decs[n].generate(ids, params):
                out += ev.tokens
                if ev.prefill:
                    t0 = time.perf_counter()
            dt = time.perf_counter() - t0
            wall[n, m] += dt
            toks[n, m] += len(out) - 1
            speed[n, m] = (len(out) - 1) / dt
            outs[n, m] = out
        if len(set(map(tuple, outs.values()))) != 1:
            raise SystemExit(f"outputs differ on prompt {i}")
        for n in decs:
            for m in args.modes[1:]:
                ratios[n, m].append(speed[n, m] / speed[n, base])
    rate = {k: toks[k] / wall[k] for k in toks}
    for n in decs:
        each = "; ".join(
            f"mode {m}: {rate[n, m]:.1f} tok/s, {rate[n, m] / rate[n, base]:.3f}x "
            f"(median per prompt {statistics.median(ratios[n, m]):.3f})"
            for m in args.modes[1:]
        )
        print(f"{n}: mode {base}: {rate[n, base]:.1f} tok/s; {each}")
    for n in decs:
        same = "  ".join(f"mode {m}: {rate[n, m] / rate['ar', m]:.3f}" for m in args.modes)
        print(f"{n} / ar, same mode: {same}")


if __name__ == "__main__":
    main()

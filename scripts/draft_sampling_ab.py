"""Sampled chains drawn from the draft beside chains of its most likely tokens, in one process.

Under sampling a drafted chain either proposes the draft's most likely tokens (accepted with the
target's probability of each: ``--no-sample-drafts``) or draws them from the draft's own
distribution and accepts each by the ratio test (``tree.sample_drafts``, the default: accepted
with probability 1 - TV(p, q) a node). Both are lossless (``tests/decoding/test_verify.py``,
``test_speculative.py``); they consume the random stream differently, so their tokens differ
and each arm is timed on its own seeded outputs. Every method runs every prompt and seed with
both arms (and ``ar`` once), the order flipping from run to run, on the tree ``--tree auto``
tuned for it on this machine (cached; or ``--tree fixed`` and the tree flags' default chain).
Prints per method and arm: decode tok/s, its ratio to AR, and on drafted rounds the share whose
first drafted token was accepted and the tokens a round gives. Used for docs/benchmarks.md,
wave 33:

    .venv/bin/python scripts/draft_sampling_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 2 --seeds 2 --temperature 1.0
"""

from __future__ import annotations

import argparse
import collections
import time
from dataclasses import replace

import torch

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.common import positive_int
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig

ARMS = {"drawn": True, "most likely": False}  # tree.sample_drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--methods", default="eagle2,frspec", help="drafted methods, comma-separated")
    ap.add_argument("--per-category", type=positive_int, default=1)
    ap.add_argument("--seeds", type=positive_int, default=1, help="seeded runs per prompt (default 1)")
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument(
        "--tree", choices=("auto", "fixed"), default="auto", help="tuned trees (default) or a chain"
    )
    ap.add_argument("--weights", default="int4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    methods = tuple(args.methods.split(","))
    settings = StackSettings(
        methods=("ar", *methods),
        weights=args.weights,
        tune_tree=args.tree == "auto",
        tree=TreeConfig(top_k=1, depth=2, total_tokens=2),
    )
    stack = assemble(settings, progress=True)
    decoders = {m: stack.decoder(m) for m in ("ar", *methods)}
    record_steps(stack.loaded.model, decoders.values())
    trees = {m: decoders[m].tree for m in methods}
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    wall, tokens = collections.Counter(), collections.Counter()
    rounds, first, made = collections.Counter(), collections.Counter(), collections.Counter()

    def run(method: str, arm: str, ids: list[int], seed: int, record: bool = True) -> None:
        dec = decoders[method]
        if method != "ar":
            dec.tree = replace(trees[method], sample_drafts=ARMS[arm])
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=seed,
        )
        n, t0 = 0, time.perf_counter()
        for ev in dec.generate(ids, params):
            if ev.prefill:
                t0 = time.perf_counter()
                continue
            n += len(ev.tokens)
            if record and ev.tree_size and not ev.looked_up:  # a drafted round
                rounds[method, arm] += 1
                first[method, arm] += ev.accepted >= 1
                made[method, arm] += ev.accepted + 1
        if record:
            wall[method, arm] += time.perf_counter() - t0
            tokens[method, arm] += n

    runs = [("ar", "-")] + [(m, arm) for m in methods for arm in ARMS]
    for m, arm in runs:  # warm-up
        run(m, arm, prompts[0], 0, record=False)
    for i, ids in enumerate(prompts):
        for s in range(args.seeds):
            order = runs if (i * args.seeds + s) % 2 == 0 else runs[::-1]
            for m, arm in order:
                run(m, arm, ids, seed=1000 * s + i)
    ar = tokens["ar", "-"] / wall["ar", "-"]
    print(
        f"{len(prompts)} prompts x {args.seeds} seeds x {args.max_new_tokens} tokens, "
        f"T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}; ar {ar:.1f} tok/s"
    )
    print(
        "| method | tree | drafted tokens | decode tok/s | vs ar | drafted rounds "
        "| first token accepted | tokens a drafted round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in methods:
        t = trees[m]
        shape = (
            f"chain {t.depth}"
            + (f", lookup {t.lookup}" if t.lookup else "")
            + (f", table {t.table_lookup}" if t.table_lookup else "")
        )
        for arm in ARMS:
            speed = tokens[m, arm] / wall[m, arm]
            n = max(rounds[m, arm], 1)
            print(
                f"| {m} | {shape} | {arm} | {speed:.1f} | {speed / ar:.3f} | {rounds[m, arm]} "
                f"| {first[m, arm] / n:.3f} | {made[m, arm] / n:.3f} |"
            )


if __name__ == "__main__":
    main()

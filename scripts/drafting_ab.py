"""A drafted round's calls against its ops, in one process: two decoders of one variant on the
same draft, one drafting through the recorded step and three head calls (``calls``), one through
``draft_step_ids`` and ``int4_top1`` (``ops``, the default), and AR beside them.

Every prompt runs all three back to back, the order rotating between prompts, after a warm-up;
outputs are checked equal to AR's. Prints each decoder's decode speed against AR's and, per
kind of round, the mean milliseconds of drafting, verify and the whole round. Used for
docs/benchmarks.md, wave 43:

    .venv/bin/python scripts/drafting_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 3 frspec:3:2:0:1
"""

from __future__ import annotations

import collections
import time

from tree_ab import variant_parser, variant_setup


def main() -> None:
    args = variant_parser(__doc__, "METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB]", 3).parse_args()
    if len(args.variants) != 1:
        raise SystemExit("give one variant")
    variant = args.variants[0]
    _, decoders, prompts, params = variant_setup(args, {"calls": variant, "ops": variant})
    calls = decoders["calls"]
    if not getattr(calls.drafter, "ids_op", False) or getattr(calls.vocab, "head", None) is None:
        method = variant.split(":")[0]
        raise SystemExit(f"{method} drafts without draft_step_ids here (it needs an int4 draft, fused ops)")
    calls.drafter.ids_op = False
    calls.vocab.head.top1_op = False
    kinds = {n: collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0]) for n in decoders}
    wall, tokens = collections.Counter(), collections.Counter()

    def run(name: str, ids: list[int], record: bool = True) -> list[int]:
        out, t0 = [], time.perf_counter()
        for ev in decoders[name].generate(ids, params):
            out += ev.tokens
            if ev.prefill:
                t0 = time.perf_counter()
                continue
            kind = "drafted" if ev.tree_size and not ev.looked_up else ("free" if ev.tree_size else "plain")
            k = kinds[name][kind]
            k[0], k[1], k[2], k[3] = k[0] + 1, k[1] + ev.draft_s, k[2] + ev.verify_s, k[3] + ev.round_s
        if record:
            wall[name] += time.perf_counter() - t0
            tokens[name] += len(out) - 1
        return out

    names = list(decoders)
    for name in names:
        run(name, prompts[0], record=False)
    for k in kinds.values():
        k.clear()
    for i, ids in enumerate(prompts):
        order = names[i % 3 :] + names[: i % 3]
        outs = {n: run(n, ids) for n in order}
        for n in names[1:]:
            if outs[n] != outs["ar"]:
                raise SystemExit(f"{n}: output differs from AR on prompt {i}")
    ar_speed = tokens["ar"] / wall["ar"]
    print(
        f"{args.variants[0]}: {len(prompts)} prompts x {args.max_new_tokens} tokens; AR {ar_speed:.1f} tok/s"
    )
    print("| decoder | vs AR | round kind | rounds | draft ms | verify ms | round ms |")
    print("|---|---|---|---|---|---|---|")
    for n in names[1:]:
        speed = tokens[n] / wall[n] / ar_speed
        for kind, (c, d, v, r) in sorted(kinds[n].items()):
            ms = " | ".join(f"{1e3 * x / c:.3f}" for x in (d, v, r))
            print(f"| {n} | {speed:.3f} | {kind} | {c} | {ms} |")


if __name__ == "__main__":
    main()

"""A drafted round's calls against its ops, in one process: two decoders of one variant on the
same draft, one drafting through the recorded step and three head calls (``calls``), one through
``draft_step_ids`` and ``int4_top1`` (``ops``, the default), and AR beside them.

Prints ``round_costs.py``'s table for the three (every prompt on each, the order rotating between
prompts, after a warm-up; outputs checked equal to AR's): decode speed against AR's and, per kind
of round, accepted tokens and the mean milliseconds of drafting, verify and the whole round.
Used for docs/benchmarks.md, wave 43:

    .venv/bin/python scripts/drafting_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 3 frspec:3:2:0:1
"""

from __future__ import annotations

from round_costs import print_round_table
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
    print_round_table(decoders, prompts, params)


if __name__ == "__main__":
    main()

"""Where a decoder's rounds spend their time, by kind of round, beside plain decoding.

Each variant uses ``scripts/tree_ab.py``'s syntax (``METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:
DEPTH[:MIN_PROB]``). Every prompt runs AR and every variant back to back (the order rotating
between prompts), after every graph is recorded and warmed; outputs are checked equal to AR's.
Rounds are split into ``drafted`` (the head proposed), ``free, n guessed`` (context lookup or
the n-gram table proposed n tokens: a verify forward of 1 + n rows) and ``plain`` (the root
alone: no proposal, or a stopping chain that drafted nothing); per kind: count, accepted tokens
per round, and mean milliseconds of drafting, of the verify forward and of the whole round.
Used for docs/benchmarks.md, waves 13 and 29:

    .venv/bin/python scripts/round_costs.py --data ../shared/data/spec_bench/question.jsonl \\
        ngram:3:2:1:1 frspec:3:2:1:1 frspec:0:2:0:1
"""

from __future__ import annotations

import collections
import time

from tree_ab import interleave, variant_parser, variant_setup


def main() -> None:
    args = variant_parser(__doc__, "METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB]", 1).parse_args()
    _, decoders, prompts, params = variant_setup(args)
    print_round_table(decoders, prompts, params)


def print_round_table(decoders: dict, prompts: list[list[int]], params) -> None:
    """Run every prompt on every decoder (``decoders["ar"]`` first among them), the order
    rotating between prompts, after a warm-up; check each output equal to AR's; print the
    table above. Also what ``drafting_ab.py`` prints."""
    # per decoder and kind: rounds, accepted, draft s, verify s, round s
    stats = {n: collections.defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0]) for n in decoders}
    wall, tokens = collections.Counter(), collections.Counter()

    def run(name: str, ids: list[int], record: bool = True) -> list[int]:
        out, t0 = [], time.perf_counter()
        for ev in decoders[name].generate(ids, params):
            out += ev.tokens
            if ev.prefill:
                t0 = time.perf_counter()
                continue
            if name == "ar":
                kind = "ar"
            elif not ev.tree_size:
                kind = "plain"
            elif ev.looked_up:
                kind = f"free, {ev.tree_size} guessed"  # the verify forward's rows: 1 + guessed
            else:
                kind = "drafted"
            if not record:
                continue
            s = stats[name][kind]
            s[0], s[1] = s[0] + 1, s[1] + ev.accepted
            s[2], s[3], s[4] = s[2] + ev.draft_s, s[3] + ev.verify_s, s[4] + (ev.round_s or ev.verify_s)
        if record:
            wall[name] += time.perf_counter() - t0
            tokens[name] += len(out) - 1
        return out

    interleave(list(decoders), prompts, run)
    ar_speed = tokens["ar"] / wall["ar"]
    print(f"{len(prompts)} prompts x {params.max_new_tokens} tokens; AR {ar_speed:.1f} tok/s (decode)")
    print("| decoder | vs AR | round kind | rounds | accepted / round | draft ms | verify ms | round ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n in decoders:
        speed = tokens[n] / wall[n] / ar_speed
        for kind, (c, a, d, v, r) in sorted(stats[n].items()):
            ms = [f"{1e3 * x / c:.2f}" for x in (d, v, r)]
            print(f"| {n} | {speed:.3f} | {kind} | {c} | {a / c:.3f} | {' | '.join(ms)} |")


if __name__ == "__main__":
    main()

"""What a round costs outside the target's forward: AR and each variant in one process.

The target's recorded forward (``models/step.py: StepGraph``) is timed on its own; per round
(per step for AR) the script prints the wall time, the forward's, the drafting the events
report (a draft, or the lookup's guess) and the rest: acceptance, bookkeeping, events -- the
Python a round runs around its forward, which runs cold after it. Every prompt runs AR and every
variant (``scripts/tree_ab.py``'s syntax), the order rotating. Used for docs/benchmarks.md,
wave 43:

    .venv/bin/python scripts/round_overhead.py --data ../shared/data/spec_bench/question.jsonl \\
        ngram:3:2:2:1 frspec:3:2:0:1
"""

from __future__ import annotations

import collections
import time

from tree_ab import interleave, variant_parser, variant_setup

from evospec.models import step as step_module


class _ForwardClock:
    """Seconds and calls spent in ``StepGraph.__call__`` while installed."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._call = step_module.StepGraph.__call__
        clock = self

        def timed(graph, *args, **kwargs):
            t = time.perf_counter()
            out = clock._call(graph, *args, **kwargs)
            clock.seconds += time.perf_counter() - t
            clock.calls += 1
            return out

        step_module.StepGraph.__call__ = timed

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def main() -> None:
    args = variant_parser(__doc__, "METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB]", 2).parse_args()
    _, decoders, prompts, params = variant_setup(args)
    clock = _ForwardClock()
    totals = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])  # wall s, rounds, forward s, drafting s

    def run(name: str, ids: list[int], record: bool = True) -> list[int]:
        out, t0, rounds, drafting = [], 0.0, 0, 0.0
        for ev in decoders[name].generate(ids, params):
            out += ev.tokens
            if ev.prefill:
                clock.take()
                t0 = time.perf_counter()
                continue
            rounds += 1
            drafting += ev.draft_s
        wall = time.perf_counter() - t0
        forward, _ = clock.take()
        if record:
            t = totals[name]
            t[0], t[1], t[2], t[3] = t[0] + wall, t[1] + rounds, t[2] + forward, t[3] + drafting
        return out

    interleave(list(decoders), prompts, run)
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens; ms a round (a step for AR)")
    print("| decoder | vs AR | rounds | wall | forward | drafting | rest |")
    print("|---|---|---|---|---|---|---|")
    ar_wall = totals["ar"][0]
    for n in decoders:
        wall, rounds, forward, drafting = totals[n]
        parts = (wall, forward, drafting, wall - forward - drafting)
        ms = " | ".join(f"{1e3 * x / rounds:.3f}" for x in parts)
        print(f"| {n} | {ar_wall / wall:.3f} | {rounds} | {ms} |")


if __name__ == "__main__":
    main()

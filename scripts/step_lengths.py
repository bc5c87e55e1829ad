"""What a decode step and a verify forward cost at each cache length, and what a prefill costs.

Records the default model's one-token step and n-row verify graphs (``models/step.py``), sets
the cache to each length (a step's cost does not depend on what the slots hold) and prints the
median milliseconds of ``--calls`` calls per shape; then times eager prefills of random prompts.
Run it from two checkouts one after the other (alternating) to compare engine changes, as in
docs/benchmarks.md, wave 14:

    .venv/bin/python scripts/step_lengths.py --lengths 300 1000 2000 4000 --rows 1 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evospec.assembly import StackSettings, assemble
from evospec.models.step import StepGraph


def median_ms(fn, calls: int, warm: int = 0) -> float:
    """The median milliseconds of ``calls`` calls of ``fn``, after ``warm`` untimed ones."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4", help="weight format (default int4)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[300, 1000, 2000, 4000], help="cache lengths")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3], help="rows per forward (1 = a step)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[50, 1200], help="prompt lengths to prefill")
    ap.add_argument("--calls", type=int, default=40, help="calls per shape (median)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = assemble(StackSettings(methods=("ar",), weights=args.weights), progress=False).loaded.model
    graph = StepGraph(model)
    cache = model.new_cache(max(args.lengths) + max(args.rows) + 1)
    print(f"KV cache {cache.k.dtype}, {args.threads} threads, median of {args.calls} calls")
    with torch.inference_mode():
        for n in args.rows:
            graph.record(n, "last" if n == 1 else "all")
        for length in args.lengths:
            cache.length = length
            cells = []
            for n in args.rows:
                tokens, positions = torch.randint(0, 40000, (1, n)), torch.arange(length, length + n)
                mode = "last" if n == 1 else "all"
                ms = median_ms(lambda: graph(tokens, positions, cache, mode), args.calls)  # noqa: B023 (called here)
                cells.append(f"{n} row(s) {ms:6.2f} ms")
            print(f"{length:5d} slots: " + "   ".join(cells))
        for p in args.prefill:
            prompt = torch.randint(0, 40000, (1, p))
            fresh = model.new_cache(p + 1)

            def prefill() -> None:
                fresh.reset()
                model(prompt, torch.arange(p), fresh, logits="last")

            prefill()  # first call: allocation
            print(f"prefill {p:5d} tokens: {median_ms(prefill, max(3, args.calls // 8)):8.1f} ms")


if __name__ == "__main__":
    main()

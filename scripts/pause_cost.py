"""What a pause before a forward costs: a recorded step's time by the time spent outside it.

A decode loop does other work between target forwards (acceptance, context lookup, the draft's
catch-up and head); speculative rounds do more of it than plain decoding. This times one
recorded one-token step after ``--pauses`` milliseconds in which the main thread only spins
(no memory traffic), and again after pauses in which both threads run a small in-cache op;
then a single int4 product as large as the model's layers together (66 MB for SmolLM2) after
the same pauses. Pause lengths alternate within each of ``--repeats`` passes; the first 5 calls
of each timing are warm-up. Prints a markdown table of medians (ms). Used for
docs/benchmarks.md, wave 26:

    .venv/bin/python scripts/pause_cost.py --pauses 0 0.4 1.6 3.2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evospec.assembly import StackSettings, assemble
from evospec.common import positive_int
from evospec.kernels.int4_matmul import pack_int4, vnni_available
from evospec.models.step import StepGraph


def _pause(ms: float, busy: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        if busy is not None:
            torch.exp(busy[0], out=busy[1])  # both threads, in cache


def _median_ms(fn, pause_ms: float, busy, calls: int) -> float:
    times = []
    for _ in range(calls):
        _pause(pause_ms, busy)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:] or times) * 1e3  # after 5 warm-up calls, where there are more


def pause_costs(
    graph: StepGraph, cache, slots: int, pauses: list[float], repeats: int, calls: int, product=None
) -> dict[float, dict[str, list[float]]]:
    """Per pause (ms): medians (ms) per pass of a recorded one-token step after ``slots`` cached
    tokens -- the main thread spinning (``spin``) or both threads busy (``busy``) during the
    pause -- and of ``product()`` where given (``product``; else empty). The cache's length is
    left as it was (each step writes the slot after it)."""
    token, position = torch.tensor([[5]]), torch.tensor([slots])
    busy = (torch.randn(200_000), torch.empty(200_000))

    def step() -> None:
        cache.length = slots
        graph(token, position, cache, "last")

    rows: dict[float, dict[str, list[float]]] = {p: {"spin": [], "busy": [], "product": []} for p in pauses}
    with torch.inference_mode():
        graph.record(1, "last")
        for _ in range(repeats):
            for p in pauses:
                rows[p]["spin"].append(_median_ms(step, p, None, calls))
                rows[p]["busy"].append(_median_ms(step, p, busy, calls))
                if product is not None:
                    rows[p]["product"].append(_median_ms(product, p, None, calls))
    cache.length = slots
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pauses", type=float, nargs="+", default=[0, 0.4, 1.6, 3.2], help="pauses in ms")
    ap.add_argument("--repeats", type=positive_int, default=3, help="passes over the pauses (default 3)")
    ap.add_argument("--calls", type=positive_int, default=150, help="timed calls a pause and pass (150)")
    ap.add_argument("--slots", type=positive_int, default=300, help="cached tokens before the step (300)")
    ap.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = assemble(StackSettings(methods=("ar",), weights="int4"), progress=False).loaded.model
    product = None
    if vnni_available():
        n, k = 16 * 11456, 576  # 66 MB packed: SmolLM2's 210 int4 linears together
        weight = pack_int4(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), -torch.rand(n, k // 32))
        x = torch.randn(1, k).to(torch.bfloat16)
        product = lambda: torch.ops.evospec.int4_matmul(x, weight)  # noqa: E731
    cache = model.new_cache(args.slots + 2)
    rows = pause_costs(StepGraph(model), cache, args.slots, args.pauses, args.repeats, args.calls, product)
    print(f"{args.slots} cached slots, {args.threads} threads, {args.repeats} passes (median of passes)")
    print("| pause ms | step, main thread spins | step, both threads busy | 66 MB int4 product |")
    print("|---|---|---|---|")
    for p, r in rows.items():
        cells = [f"{statistics.median(v):.2f}" if v else "-" for v in (r["spin"], r["busy"], r["product"])]
        print(f"| {p:g} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

"""Per-shape cost of a verify forward's linear layers on this CPU: F.linear vs MKL- and oneDNN-packed.

Why: verifying a few tree tokens at once costs far more than one AR step on small CPUs (BLAS is
inefficient at 2-16 rows). This times the layer shapes of a target (default: SmolLM2-135M) at
M = 1..16 rows, side by side in one process, medians of 9 runs.

    .venv/bin/python scripts/bench_linear.py [--hidden 576 --inter 1536 --kv 192 --layers 30 --vocab 49152]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from evospec.models.packing import BATCH_HINT


def _median_ms(fn, reps: int = 9) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _packed(x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor], m: int) -> list:
    return [torch.ops.mkl._mkl_linear(x, q, w, None, m) for q, w in zip(packed, weights, strict=True)]


def _onednn(x: torch.Tensor, packed: list[torch.Tensor]) -> list:
    return [torch.ops.mkldnn._linear_pointwise(x, q, None, "none", [], "") for q in packed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--inter", type=int, default=1536)
    p.add_argument("--kv", type=int, default=192)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    a = p.parse_args()
    d, n = a.hidden, a.layers
    shapes = [(d, d, 2 * n), (d, a.kv, 2 * n), (d, a.inter, 2 * n), (a.inter, d, n), (d, a.vocab, 1)]
    torch.manual_seed(0)
    totals: dict[int, list[float]] = {}
    print("| in -> out (count) | M | F.linear ms | MKL-packed ms | oneDNN-packed ms |\n|---|---|---|---|---|")
    for fan_in, fan_out, count in shapes:
        weights = [torch.randn(fan_out, fan_in) for _ in range(count)]
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT) for w in weights]  # as evospec packs
        for m in (1, 2, 4, 8, 16):
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            x = torch.randn(m, fan_in)
            plain = _median_ms(lambda x=x, ws=weights: [F.linear(x, w) for w in ws])
            mkl = _median_ms(lambda x=x, ws=weights, ps=packed, m=m: _packed(x, ws, ps, m))
            one = _median_ms(lambda x=x, ps=dnn: _onednn(x, ps))
            totals.setdefault(m, [0.0, 0.0, 0.0])
            for i, v in enumerate((plain, mkl, one)):
                totals[m][i] += v
            print(
                f"| {fan_in} -> {fan_out} ({count}) | {m} | {plain:.2f} | {mkl:.2f} | {one:.2f} |", flush=True
            )
    for m, (plain, mkl, one) in totals.items():
        print(
            f"all layers, M={m}: F.linear {plain:.1f} ms, MKL-packed {mkl:.1f} ms ({plain / mkl:.2f}x), "
            f"oneDNN-packed {one:.1f} ms ({plain / one:.2f}x)"
        )


if __name__ == "__main__":
    main()

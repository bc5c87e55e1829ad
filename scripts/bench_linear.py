"""Per-shape cost of a verify forward's linear layers on this CPU: F.linear vs MKL- and oneDNN-packed.

Why: verifying a few tree tokens at once costs far more than one AR step on small CPUs (BLAS is
inefficient at 2-16 rows). This times the layer shapes of a target (default: SmolLM2-135M) at
M = 1..16 rows, side by side in one process, medians of 9 runs.

    .venv/bin/python scripts/bench_linear.py [--hidden 576 --inter 1536 --kv 192 --layers 30 --vocab 49152]

``--formats`` instead times the weight formats of ``evospec.models.quant`` (the fused groups a
loaded model runs: q/k/v, o, gate/up, down per layer, and the LM head) against oneDNN fp32:

    .venv/bin/python scripts/bench_linear.py --formats

``--rows C`` instead times the reduced draft head's product over a [C, hidden] row buffer
(``evospec.models.packing.PackedRows``) at 1 row: dense vs block-packed, and one block repack.

    .venv/bin/python scripts/bench_linear.py --rows 16582 --hidden 640     # Gemma's 16k core + ARC
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from evospec.models.packing import BATCH_HINT, PackedRows


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
    p.add_argument("--rows", type=int, default=None, help="time a reduced head of this many rows instead")
    p.add_argument("--formats", action="store_true", help="time the weight formats (int4/int8/bf16/fp32)")
    a = p.parse_args()
    if a.rows:
        return _rows(a.rows, a.hidden)
    if a.formats:
        return _formats(a)
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


def _formats(a: argparse.Namespace) -> None:
    """ms per call of all fused layer matmuls (and the LM head) per weight format and row count."""
    from evospec.models.quant import Bf16Matmul, GroupCodes, Int4Matmul, Int8Matmul

    d, kv, inter = a.hidden, a.kv, a.inter
    shapes = [(d, d + 2 * kv), (d, d), (d, 2 * inter), (inter, d)] * a.layers  # qkv, o, gate_up, down
    torch.manual_seed(0)
    weights = [torch.randn(o, i) * 0.02 for i, o in shapes]
    head = torch.randn(a.vocab, d) * 0.02
    makers = {
        "fp32 (oneDNN)": lambda w: _OneDnn(w),
        "bf16": lambda w: Bf16Matmul(w, None, [w.shape[0]]),
        "int8": lambda w: Int8Matmul(w, None, [w.shape[0]]),
        "int4": lambda w: Int4Matmul(GroupCodes.from_float(w), None, [w.shape[0]]),
    }
    print("| format | M | layers ms | LM head ms |\n|---|---|---|---|")
    for name, make in makers.items():
        layer_mm = [make(w) for w in weights]
        head_mm = make(head)
        for m in (1, 2, 4, 8, 16):
            xs = {k: torch.randn(m, k) for k in (d, inter)}
            t_layers = _median_ms(lambda ms=layer_mm, xs=xs: [f(xs[f.in_features]) for f in ms])
            t_head = _median_ms(lambda xs=xs, h=head_mm: h(xs[d]))
            print(f"| {name} | {m} | {t_layers:.2f} | {t_head:.2f} |", flush=True)


class _OneDnn:
    def __init__(self, w: torch.Tensor) -> None:
        self.in_features = w.shape[1]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def _rows(c: int, d: int) -> None:
    torch.manual_seed(0)
    rows, x = torch.randn(c, d), torch.randn(1, d)
    print(f"| [{c}, {d}] rows, 1 input row | ms |\n|---|---|")
    print(f"| dense x @ rows.T | {_median_ms(lambda: x @ rows.T, 25):.2f} |")
    for block in (2048, 4096, 8192, c):
        packed = PackedRows(rows, block)
        print(f"| PackedRows, {block}-row blocks | {_median_ms(lambda p=packed: p(x), 25):.2f} |")
    packed = PackedRows(rows, 4096)
    packed(x)
    slot = torch.tensor([0])

    def repack() -> None:
        packed.touch(slot)
        packed(x)

    print(f"| one 4096-row block repacked + call | {_median_ms(repack, 9):.2f} |")


if __name__ == "__main__":
    main()

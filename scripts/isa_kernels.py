"""What the int8-activation kernels and decode attention cost under this build's instruction set.

Times, on the op library the environment builds (``EVOSPEC_CPU_CFLAGS="-mno-avx512f"`` for the
AVX-VNNI variant, ``"-mno-avx512f -mno-avxvnni"`` for plain AVX2; ``ATEN_CPU_CAPABILITY=avx2``
holds torch's own kernels to AVX2 as well): a 66 MB int4 product (SmolLM2's 210 linears
together) and the int8 LM head (49,152 x 576) at 1-4 rows, and one layer's decode attention
(9 query heads over 3 KV heads of 64, f16 cache) at a few cached lengths and rows. Medians of
``--repeats`` timings of ``--calls`` calls each, ms (products) and us (attention), 2 threads.
Used for docs/benchmarks.md, wave 27:

    EVOSPEC_CPU_CFLAGS="-mno-avx512f -mno-avxvnni" .venv/bin/python scripts/isa_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from evospec.common import positive_int
from evospec.kernels.int4_matmul import kernel_isa, pack_int4
from evospec.kernels.int8_matmul import pack_int8


def median_s(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean seconds a call of ``fn`` takes (``calls`` in a row,
    after ``calls`` warm-up calls)."""
    for _ in range(calls):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def product_ms(n: int, k: int, rows: list[int], calls: int, repeats: int) -> dict[str, list[float]]:
    """ms per int4 [n, k] and int8 LM-head-sized product, per row count."""
    w4 = pack_int4(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), -torch.rand(n, k // 32))
    w8, s8 = pack_int8(torch.randint(-127, 128, (49152, k), dtype=torch.int8)), torch.rand(49152)
    int4, int8 = torch.ops.evospec.int4_matmul, torch.ops.evospec.int8_matmul
    out: dict[str, list[float]] = {"int4": [], "int8 LM head": []}
    for m in rows:
        x = torch.randn(m, k)
        out["int4"].append(median_s(partial(int4, x.bfloat16(), w4), calls, repeats) * 1e3)
        out["int8 LM head"].append(median_s(partial(int8, x, w8, s8), calls, repeats) * 1e3)
    return out


def attention_us(lengths: list[int], rows: list[int], calls: int, repeats: int) -> dict:
    """us per layer of decode attention, per (cached slots, rows)."""
    out = {}
    for s in lengths:
        for n in rows:
            q = torch.randn(1, 9, n, 64)
            k, v = torch.randn(1, 3, s, 64).half(), torch.randn(1, 3, s, 64).half()
            fn = partial(torch.ops.evospec.decode_attention, q, k, v, None, 0.125, 0)
            out[(s, n)] = median_s(fn, calls, repeats) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 3, 4], help="product rows")
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[300, 1000, 2000], help="cached slots")
    ap.add_argument("--attention-rows", type=positive_int, nargs="+", default=[1, 4], help="attention rows")
    ap.add_argument("--int4-outputs", type=positive_int, default=16 * 11456, help="int4 product N (66 MB)")
    ap.add_argument("--calls", type=positive_int, default=30, help="calls a timing (30)")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timings, median taken (7)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    isa = kernel_isa()
    if isa == "none":
        raise SystemExit("isa_kernels.py: the op library has no int8-activation kernels here (needs AVX2)")
    print(f"kernels: {isa}")
    products = product_ms(args.int4_outputs, 576, args.rows, args.calls, args.repeats)
    print("| product, ms | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, values in products.items():
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    attention = attention_us(args.lengths, args.attention_rows, args.calls, args.repeats)
    print("\n| cached slots / rows | " + " | ".join(f"{s} / {n}" for s, n in attention) + " |")
    print("|---|" + "---|" * len(attention))
    print("| decode attention, us a layer | " + " | ".join(f"{v:.1f}" for v in attention.values()) + " |")


if __name__ == "__main__":
    main()

"""Two checkouts' decode attention in one process: the same bits, and each one's time.

Builds each tree's op library (its ``evospec/kernels`` sources, this machine's flags) under its
own op namespace (``-Devospec=NS``: ``torch.ops.NS.decode_attention``), loads both, checks that
they give the same bits over a few hundred shapes (head sizes 32-256, 1-16 rows, 7-1,100 keys, grouped
queries, masks, sliding windows, f32 and f16 caches), then times them call block by call block,
alternating (the order flips each repeat), so that a machine whose speed drifts from minute to
minute times both under the same conditions. SmolLM2's shape: 9 query heads over 3 KV heads of
64, an f16 cache; each block of calls walks the KV of ``--layers`` different caches, as a step's
layers do, so long contexts stream from memory. Medians, us a layer. Used for
docs/benchmarks.md, wave 31:

    git worktree add /tmp/base HEAD~1
    .venv/bin/python scripts/attention_ab.py /tmp/base .
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import platform
import statistics
import time
from pathlib import Path

import torch

from evospec.common import evospec_home, positive_int
from evospec.kernels.cpu_ops import CFLAGS, LDFLAGS, SOURCES, _cpu_flags


def load_tree(tree: Path, namespace: str) -> object:
    """``torch.ops.<namespace>``: the op library of ``tree``'s kernel sources, built once into
    the kernels cache (keyed, as the library's own build, by the sources, the flags, torch and
    the CPU). Only its ``decode_attention`` is used here: ops that look another op up by name
    (``"evospec::..."`` strings) would still find the installed library's."""
    from torch.utils import cpp_extension

    sources = [tree / "evospec" / "kernels" / src.name for src in SOURCES]
    sources = [s for s in sources if s.exists()]  # an older tree: attention_op.cpp came in wave 44
    headers = sorted((tree / "evospec" / "kernels").glob("*.h"))
    flags = [*CFLAGS, f"-Devospec={namespace}"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (*sources, *headers)))
    for part in (" ".join(flags), torch.__version__, platform.machine(), _cpu_flags()):
        key.update(part.encode())
    folder = evospec_home() / "kernels" / f"ab-{key.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"evospec_cpu_ops_{namespace}"
    lib = folder / f"{name}.so"
    if lib.exists():
        torch.ops.load_library(str(lib))
    else:
        print(f"building {tree}'s op library as torch.ops.{namespace} in {folder}", flush=True)
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=flags,
            extra_ldflags=list(LDFLAGS),
            build_directory=str(folder),
            is_python_module=False,
        )
    return getattr(torch.ops, namespace)


def check_shapes(ops: list, seed: int = 0) -> int:
    """Compare the libraries' outputs bit for bit over a grid of shapes; returns how many."""
    gen = torch.Generator().manual_seed(seed)
    count = 0
    dtypes = (torch.float16, torch.float32)
    grid = itertools.product((32, 64, 80, 128, 256), (1, 2, 3, 4, 5, 9, 16), (7, 64, 333, 1100), dtypes)
    for dh, n, s, dtype in grid:
        for h, hk, b, window, masked in ((9, 3, 1, 0, False), (4, 4, 2, 0, n == 1), (8, 2, 1, 48, False)):
            if n > s:
                continue
            q = torch.randn(b, h, n, dh, generator=gen)
            k = torch.randn(b, hk, s, dh, generator=gen).to(dtype)
            v = torch.randn(b, hk, s, dh, generator=gen).to(dtype)
            mask = torch.rand(b * s, generator=gen) > 0.3 if masked else None
            outs = [op.decode_attention(q, k, v, mask, dh**-0.5, window) for op in ops]
            for other in outs[1:]:
                if not torch.equal(outs[0], other):
                    raise SystemExit(f"outputs differ: dh {dh}, rows {n}, slots {s}, {dtype}, heads {h}/{hk}")
            count += 1
    return count


def time_pair(ops: list, names: list[str], lengths, rows, layers: int, calls: int, repeats: int) -> None:
    print("| cached slots / rows | " + " | ".join(names) + " | ratio |")
    print("|---|" + "---|" * (len(names) + 1))
    for s, n in itertools.product(lengths, rows):
        q = torch.randn(1, 9, n, 64)
        kv = [(torch.randn(1, 3, s, 64).half(), torch.randn(1, 3, s, 64).half()) for _ in range(layers)]
        times: list[list[float]] = [[] for _ in ops]
        for r in range(repeats):
            order = range(len(ops)) if r % 2 == 0 else reversed(range(len(ops)))
            for i in order:
                fn = ops[i].decode_attention
                start = time.perf_counter()
                for c in range(calls):
                    k, v = kv[c % layers]
                    fn(q, k, v, None, 0.125, 0)
                times[i].append((time.perf_counter() - start) / calls * 1e6)
        med = [statistics.median(t) for t in times]
        cells = " | ".join(f"{m:.1f}" for m in med)
        print(f"| {s} / {n} | {cells} | {med[1] / med[0]:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, type=Path, help="two checkouts: the base, then the change")
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[300, 1000, 4000], help="cached slots")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 3], help="query rows (chain rows)")
    ap.add_argument("--layers", type=positive_int, default=30, help="caches each call block walks")
    ap.add_argument("--calls", type=positive_int, default=30, help="calls a timing")
    ap.add_argument("--repeats", type=positive_int, default=15, help="timings of each, alternated")
    ap.add_argument("--threads", type=positive_int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = [load_tree(tree.resolve(), f"evospec_ab{i}") for i, tree in enumerate(args.trees)]
    print(f"{check_shapes(ops)} shapes: the same bits")
    names = [str(t) for t in args.trees]
    time_pair(ops, names, args.lengths, args.rows, args.layers, args.calls, args.repeats)


if __name__ == "__main__":
    main()

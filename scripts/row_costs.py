"""Where a verified row's cost goes: the default model's forward of 1..n rows, split by op.

A speculative round verifies 1 + k rows in one target forward; on a CPU each row past the first
adds compute, not weight reads (the weights stream once per forward). This script times, on
the loaded default model (``--weights``), at each cache length:

- ``forward``: the recorded n-row forward (``models/step.py``), as a verify round runs it;
- ``int4``: the 4 x layers int4 matmuls of its blocks, back to back on the real packed weights;
- ``attention``: ``decode_attention`` of every layer over the cache (random f16 keys/values);
- ``lm_head``: the target's LM head over the n rows;
- ``rest``: forward minus those three (norms, RoPE, SiLU, K/V writes, op dispatch).

Each cell is the median milliseconds of ``--calls`` calls; the ``+row`` columns are the cost
over one row, divided by the extra rows. docs/benchmarks.md (wave 23) quotes its output:

    .venv/bin/python scripts/row_costs.py --lengths 300 1000 --rows 1 2 3 4

Run it on a quiet machine (no CI, training or benchmark on the same cores).
"""

from __future__ import annotations

import argparse

import torch
from step_lengths import median_ms  # this folder's (a script's own folder leads sys.path)

from evospec.assembly import StackSettings, assemble
from evospec.kernels.int4_matmul import GROUP
from evospec.models.step import StepGraph

PARTS = ("forward", "int4", "attention", "lm_head", "rest")
WARM = 3  # untimed calls before each cell


def part_costs(model, graph: StepGraph, cache, length: int, n: int, calls: int) -> dict[str, float]:
    """Median ms of each part for an n-row forward after ``length`` cached slots."""
    ops = torch.ops.evospec
    dim = model.cfg.hidden_size
    tokens = torch.randint(0, model.cfg.vocab_size, (1, n))
    positions = torch.arange(length, length + n)
    cache.length = length
    mode = "last" if n == 1 else "all"
    out = {"forward": median_ms(lambda: graph(tokens, positions, cache, mode), calls, WARM)}

    mats = []  # (packed weight, its input width)
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        for m in (attn.qkv, attn.o_proj.matmul, mlp.gate_up, mlp.down_proj.matmul):
            mats.append((m.packed, m.packed.shape[1] * GROUP))  # packed [N/16, K/32, 320]
    inputs = {k: torch.randn(n, k).to(torch.bfloat16) for k in {k for _, k in mats}}
    out["int4"] = median_ms(lambda: [ops.int4_matmul(inputs[k], w) for w, k in mats], calls, WARM)

    attn = model.layers[0].self_attn
    heads, kv, dh = attn.num_heads, attn.num_kv_heads, model.cfg.head_dim
    keys = torch.randn(len(model.layers), 1, kv, length + n, dh).to(cache.k.dtype)
    values = torch.randn_like(keys)
    q = torch.randn(1, heads, n, dh)
    out["attention"] = median_ms(
        lambda: [ops.decode_attention(q, keys[i], values[i], None, attn.scale, 0) for i in range(len(keys))],
        calls,
        WARM,
    )
    hidden = torch.randn(1, n, dim)
    out["lm_head"] = median_ms(lambda: model.project_logits(hidden), calls, WARM)
    out["rest"] = out["forward"] - out["int4"] - out["attention"] - out["lm_head"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--weights", default="int4", help="weight format (default int4: the fused ops' int4 kernel)"
    )
    ap.add_argument(
        "--lengths", type=int, nargs="+", default=[300, 1000], help="cached slots before the rows"
    )
    ap.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 3, 4], help="rows per forward; the first is the base"
    )
    ap.add_argument("--calls", type=int, default=30, help="calls per cell (median)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if min(args.rows) < 1 or min(args.lengths) < 1 or args.calls < 1:
        ap.error("--rows, --lengths and --calls must be positive")
    torch.set_num_threads(args.threads)
    model = assemble(StackSettings(methods=("ar",), weights=args.weights), progress=False).loaded.model
    if not getattr(model, "fused_ops", False):
        raise SystemExit(
            "row_costs.py times the fused CPU ops (int4 kernel, decode_attention); this build has none"
        )
    graph = StepGraph(model)
    cache = model.new_cache(max(args.lengths) + max(args.rows) + 1)
    base = args.rows[0]
    print(f"{args.threads} threads, KV cache {cache.k.dtype}, median ms of {args.calls} calls")
    print("| slots | rows | " + " | ".join(PARTS) + " | " + " | ".join(f"{p} +row" for p in PARTS) + " |")
    print("|---" * (2 + 2 * len(PARTS)) + "|")
    with torch.inference_mode():
        for n in args.rows:
            graph.record(n, "last" if n == 1 else "all")
        for length in args.lengths:
            first = None
            for n in args.rows:
                cost = part_costs(model, graph, cache, length, n, args.calls)
                first = first or cost
                extra = [(cost[p] - first[p]) / (n - base) if n > base else float("nan") for p in PARTS]
                cells = [f"{cost[p]:.2f}" for p in PARTS] + ["" if x != x else f"{x:+.2f}" for x in extra]
                print(f"| {length} | {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

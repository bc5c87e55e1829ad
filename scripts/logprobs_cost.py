"""What reporting ``logprobs`` costs: one row's log-probabilities (``decoding/logprobs.py``) timed
alone, and plain decoding of Spec-Bench prompts with and without them, alternated in one process.

Usage (docs/benchmarks.md, wave 35):

    .venv/bin/python scripts/logprobs_cost.py --prompts 6 --max-new-tokens 64 --passes 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Spec-Bench questions (default: shared)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts, every 30th question (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3, help="passes each way, alternated (default 3)")
    ap.add_argument("--top", type=int, default=5, help="alternatives per token in the decoding runs")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from evospec.assembly import StackSettings, assemble
    from evospec.decoding.autoregressive import generate_ar
    from evospec.decoding.logprobs import row_logprobs
    from evospec.decoding.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    stack = assemble(StackSettings(methods=("ar",), weights="int4"), progress=False)
    model, codec = stack.loaded.model, stack.codec
    rows = [json.loads(line) for line in args.data.read_text().splitlines()][::30][: args.prompts]
    prompts = [codec.encode_chat([{"role": "user", "content": q["turns"][0]}]) for q in rows]
    vocab = model.cfg.vocab_size
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3
    for top in (0, 5, 20):
        times = []
        for _ in range(200):
            t = time.perf_counter()
            row_logprobs(row, [7], top)
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        print(f"one row of {vocab} ids, {top} alternatives: {ms:.3f} ms")
    speed: dict[str, list[float]] = {"without": [], "with": []}
    for p in range(args.passes):
        for way in ("without", "with") if p % 2 == 0 else ("with", "without"):
            top = args.top if way == "with" else None
            params = SamplingParams(max_new_tokens=args.max_new_tokens, logprobs=top)
            n, t0 = 0, time.perf_counter()
            for ids in prompts:
                n += sum(len(ev.tokens) for ev in generate_ar(model, ids, params))
            speed[way].append(n / (time.perf_counter() - t0))
    med = {way: statistics.median(v) for way, v in speed.items()}
    for way, v in speed.items():
        print(f"plain decoding {way} logprobs: {med[way]:.1f} tok/s (passes {[round(x, 1) for x in v]})")
    print(f"ratio with / without: {med['with'] / med['without']:.3f}")


if __name__ == "__main__":
    main()

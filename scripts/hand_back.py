"""What handing the batch's last request back to the decoder's method is worth: a long request
that shared the batch with a short one finishes alone, with the method (``ngram``) or as a
batch of one, alternated in one process.

Contract. This script builds the default model's stack with ``--method`` (default ``ngram``: what
``--method auto`` serves on the AVX2 CPUs measured so far) and an engine with ``--max-batch 2``;
for each of ``--prompts`` Spec-Bench prompts, ``--passes`` times, it submits a long greedy
request (``--max-tokens``) and right behind it a short one (``--short`` tokens, another prompt):
the long one starts alone, is handed over to the batch once the short one waits, and is alone
again once the short one ends. With the hand-back the decoder resumes it; without (the engine's
``_hand_back`` switched off) it finishes as a batch of one. It prints the long requests' median
time from submission to their last token each way, their ratio and the ratios paired by prompt
and pass (median, geometric mean), and checks both ways produced the same tokens.

Usage (docs/benchmarks.md, wave 35):

    .venv/bin/python scripts/hand_back.py --prompts 8 --passes 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()
        self.end = 0.0

    def __call__(self, item) -> None:
        from service.engine import Done

        if isinstance(item, Done):
            self.end = time.perf_counter()
            self.done.set()
        else:
            self.tokens += item.tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Spec-Bench questions (default: shared)")
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--prompts", type=int, default=8, help="long requests' prompts, spread over the set")
    ap.add_argument("--passes", type=int, default=2, help="passes each way, alternated (default 2)")
    ap.add_argument("--max-tokens", type=int, default=128, help="the long requests' max_tokens")
    ap.add_argument("--short", type=int, default=8, help="the short requests' max_tokens")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from evospec.assembly import StackSettings, assemble
    from evospec.decoding.sampling import SamplingParams
    from service.engine import Engine, GenerationRequest

    torch.set_num_threads(args.threads)
    stack = assemble(StackSettings(methods=(args.method,), weights="int4"), progress=False)
    codec = stack.codec
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    step = max(len(rows) // args.prompts, 1)
    prompts = [codec.encode_chat([{"role": "user", "content": r["turns"][0]}]) for r in rows[::step]]
    engine = Engine(stack.decoder(args.method), max_queue=8, max_batch=2)
    engine.start()
    hand_back = engine._hand_back
    long_p, short_p = (
        SamplingParams(max_new_tokens=args.max_tokens),
        SamplingParams(max_new_tokens=args.short),
    )
    times: dict[str, list[float]] = {"method": [], "batch of one": []}
    tokens: dict[str, list[list[int]]] = {"method": [], "batch of one": []}
    try:
        for p in range(args.passes):
            for way in ("method", "batch of one") if p % 2 == 0 else ("batch of one", "method"):
                engine._hand_back = hand_back if way == "method" else (lambda: False)
                for i, ids in enumerate(prompts[: args.prompts]):
                    long, short = _Sink(), _Sink()
                    other = prompts[(i + 1) % len(prompts)]
                    t0 = time.perf_counter()
                    engine.submit(GenerationRequest(ids, long_p, 600), long)
                    engine.submit(GenerationRequest(other, short_p, 600), short)
                    assert long.done.wait(600) and short.done.wait(600)
                    times[way].append(long.end - t0)
                    tokens[way].append(long.tokens)
    finally:
        engine.stop()
    med = {way: statistics.median(v) for way, v in times.items()}
    for way, v in times.items():
        print(f"long request, {way}: median {med[way]:.3f} s over {len(v)}")
    print(f"batch of one / method: {med['batch of one'] / med['method']:.3f}")
    paired = [b / m for m, b in zip(times["method"], times["batch of one"], strict=True)]  # same prompt
    print(f"paired by prompt and pass: median {statistics.median(paired):.3f}, "
          f"geometric mean {statistics.geometric_mean(paired):.3f}")  # fmt: skip
    same = tokens["method"] == tokens["batch of one"]
    print(f"the same tokens both ways: {same}")


if __name__ == "__main__":
    main()

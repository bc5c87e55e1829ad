"""What a batched step costs beside one-token steps: ``step_sequences`` over B sequences against
the recorded one-token step of one of them, call by call alternated, in one process.

Each of ``--rows`` (max) sequences gets a prompt of ``--length`` tokens prefilled into a cache of
its own; then, ``--calls`` times, one recorded step of sequence 0 and one ``step_sequences`` call
over sequences 0..B-1 (every cache trimmed back after each call, so positions stay put). Prints
per B: the median ms of each and the tokens per second of the batched call over B steps one at
a time (B x step / batched). Used for docs/engine.md, "Batched plain decoding":

    .venv/bin/python scripts/batch_steps.py --rows 1 2 3 4 --length 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evospec.assembly import StackSettings, assemble
from evospec.models.batch_step import batched_steps_apply, step_sequences


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4], help="sequences per batched call")
    p.add_argument("--length", type=int, default=300, help="prompt tokens of each sequence (default 300)")
    p.add_argument("--calls", type=int, default=60, help="alternated calls per B (default 60)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = assemble(StackSettings(methods=("ar",), weights="int4"), progress=False).decoder("ar").model
    if not batched_steps_apply(model):
        raise SystemExit("this model / CPU cannot step several sequences in one forward")
    caches = []
    for i in range(max(args.rows)):
        cache = model.new_cache(args.length + 8)
        prompt = [(100 + 7 * i + j) % model.cfg.vocab_size for j in range(args.length)]
        model(torch.tensor([prompt]), torch.arange(args.length), cache, logits="none")
        caches.append(cache)
    print("| rows | batched call ms | one-token step ms | tokens/s vs steps one at a time |")
    print("|---|---|---|---|")
    for b in args.rows:
        batched, solo = [], []
        for _ in range(args.calls):
            c = caches[0]
            t = time.perf_counter()
            model(torch.tensor([[5]]), torch.tensor([c.length]), c, logits="last")
            solo.append(time.perf_counter() - t)
            c.trim(c.length - 1)
            t = time.perf_counter()
            step_sequences(model, [5] * b, caches[:b])
            batched.append(time.perf_counter() - t)
            for c in caches[:b]:
                c.trim(c.length - 1)
        mb, ms = statistics.median(batched), statistics.median(solo)
        print(f"| {b} | {1e3 * mb:.2f} | {1e3 * ms:.2f} | {b * ms / mb:.2f}x |")


if __name__ == "__main__":
    main()

"""What a draft step costs on a CPU, warm and right after a target step: the parts of a drafted
round's drafting, one at a time, on the loaded default model and its shipped head.

A drafted round first catches the draft up on the pairs verified since it last drafted (one
row after a drafted round, several after lookup rounds), then projects the last draft feature
onto the active vocabulary (the reduced LM head) and takes its top-1; each further chain token
is one more draft step and projection. Between two rounds the target's verify streams ~94 MB
of weights through a 32 MB L3, so the round's first draft step and projection read their
weights from DRAM ("after a step"); a chain's later steps find them in cache ("warm"). This
script times, for ``--method`` (default frspec, 12k active ids), medians of ``--calls`` calls:

- ``catch-up n``: the draft step over n verified pairs (its recorded graph);
- ``project``, ``log_softmax``, ``top-1``: the reduced head's parts for one row;
- ``draft head``: the whole head call the drafter makes (the vocabulary's entry point);
- ``target step``: one plain decode step (what evicts the draft's weights).

Used for docs/benchmarks.md, wave 38:

    .venv/bin/python scripts/draft_costs.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from evospec.assembly import StackSettings, assemble
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams


def median_ms(fn: Callable[[], None], calls: int, before: Callable[[], None] | None = None) -> float:
    """Median milliseconds of ``fn`` over ``calls`` calls, each after ``before`` (untimed)."""
    times = []
    for _ in range(calls):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="frspec", help="a vocabulary method (its reduced head)")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=(args.method,), weights=args.weights), progress=False)
    dec = stack.decoder(args.method)
    model = stack.loaded.model
    record_steps(model, [dec])
    ids = stack.codec.encode_chat(
        [{"role": "user", "content": "Write a short story about a robot who paints."}]
    )
    list(dec.generate(ids, SamplingParams(max_new_tokens=32)))  # a live draft cache and active set
    drafter, vocab = dec.drafter, dec.vocab
    head, width = vocab.head, drafter.head.cfg.hidden_size
    cache = model.new_cache(256)
    model(torch.tensor([[5] * 8]), torch.arange(8), cache, logits="last")

    def target_step() -> None:
        cache.trim(8)
        model(torch.tensor([[7]]), torch.tensor([8]), cache, logits="last")

    def catch_up(n: int) -> Callable[[], None]:
        feats, tokens = torch.randn(n, width), torch.randint(0, 1000, (n,))

        def run() -> None:
            start = drafter.cache.length
            drafter.catch_up(feats, tokens)
            drafter.cache.trim(start)
            drafter.committed = start

        return run

    hidden = drafter._last  # [1, D] the last committed pair's draft feature
    logits = head._project(hidden).float() + head.bias
    logp = torch.log_softmax(logits, dim=-1)
    parts = {
        **{f"catch-up {n}": catch_up(n) for n in (1, 2, 4, 8)},
        "project": lambda: head._project(hidden),
        "log_softmax": lambda: torch.log_softmax(logits, dim=-1),
        "top-1": lambda: torch.topk(logp, 1, dim=-1),
        "draft head": lambda: vocab.draft_head(hidden, 1),
    }
    print(f"{args.method}: {head.size} active ids; 2 threads; median ms of {args.calls} calls")
    print("| part | warm | after a target step |")
    print("|---|---|---|")
    with torch.inference_mode():
        for name, fn in parts.items():
            warm = median_ms(fn, args.calls)
            cold = median_ms(fn, args.calls, before=target_step)
            print(f"| {name} | {warm:.3f} | {cold:.3f} |")
        print(f"| target step | {median_ms(target_step, args.calls):.3f} | |")


if __name__ == "__main__":
    main()

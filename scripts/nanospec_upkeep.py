"""What NanoSpec's per-round window upkeep costs on its own (warm caches), SmolLM2's vocabulary.

Times, median of 300 calls on 2 threads, the two pieces a nanospec round adds beside drafting
and verification: ``NanoSpecVocab.observe`` (the verified rows' top-3 over the full vocabulary
pushed into the window; two rows of random logits, a 3-token chain's tree) and
``ActiveVocab._load`` (the window's set loaded into the reduced head: slot diff and new rows).
In the decode loop the same work measured 0.94 ms a round (docs/benchmarks.md, wave 16),
against ~0.19 ms here: a verify forward flushes the caches between rounds. Used for wave 16:

    .venv/bin/python scripts/nanospec_upkeep.py
"""

from __future__ import annotations

import time

import torch

from evospec.vocab.active import ActiveVocab
from evospec.vocab.policy import NanoSpecVocab, RoundFeedback

V, D = 49152, 576  # SmolLM2-135M's vocabulary and width


def _median_us(fn, calls: int = 300) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[calls // 2] * 1e6


def main() -> None:
    torch.set_num_threads(2)
    policy = NanoSpecVocab(V)
    active = ActiveVocab(policy, torch.randn(V, D), always_ids=[2])
    active.start(torch.randint(0, V, (60,)), torch.randn(60, D))
    logits, tree = torch.randn(2, V), torch.randint(0, V, (4,))

    def observe() -> None:
        policy.observe(RoundFeedback(tree, tree[:2], logits, torch.randn(D), False, 0))

    def load() -> None:
        active._load(policy.active_mask(0))

    print(f"observe {_median_us(observe):.1f} us, load {_median_us(load):.1f} us")
    print(f"of which topk(3) over 2 rows {_median_us(lambda: torch.topk(logits, 3, dim=-1)):.1f} us")


if __name__ == "__main__":
    main()

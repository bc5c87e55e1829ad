"""What context lookup could win on this machine: match statistics on plain-decoding outputs,
and what verifying n rows costs.

For each position of the AR answers to Spec-Bench prompts: the longest n <= 5 such that the
context's last n tokens occurred earlier, and how many of the tokens that followed that
occurrence are the target's next ones (``decoding/lookup.py``'s proposal). Then the target
forward over 1..6 chained rows after a 300-token prefix (median of ``--reps``), the cost an
extra verified row adds. Prints two markdown tables (docs/benchmarks.md, wave 7), and where
the model has an n-gram table (``decoding/ngram_table.py``), a third: at the positions where
context lookup (n >= 2) finds nothing, how often the table has a guess and how often it is
right, by the guess's share (wave 8).

    .venv/bin/python scripts/lookup_study.py --data ../shared/data/spec_bench/question.jsonl \
        --per-category 3 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from tqdm.auto import tqdm

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.lookup import ContextLookup
from evospec.decoding.sampling import SamplingParams

MAX_N = 5


def longest_match(ctx: list[int], k: int) -> tuple[int, list[int]]:
    """(n, up to k following tokens) of the longest earlier occurrence of ctx's last n tokens."""
    lookup = ContextLookup(1, MAX_N)
    lookup.reset(ctx)
    match = lookup.find()
    if match is None:
        return 0, []
    n, start = match
    return n, ctx[start : start + k]


def unmatched(prompt: list[int], out: list[int]):
    """(j, context) for each position j of the answer ``out`` where context lookup with n >= 2
    (``ngram``'s) finds nothing: where a model-free source other than the context is asked."""
    for j in range(len(out)):
        ctx = prompt + out[:j]
        if longest_match(ctx, 3)[0] < 2:
            yield j, ctx


def accepted(guess: list[int], out: list[int], j: int) -> int:
    """Tokens of ``guess`` that verification accepts at position j of ``out`` (greedy)."""
    a = 0
    while a < len(guess) and j + a < len(out) and guess[a] == out[j + a]:
        a += 1
    return a


SHARE_BUCKETS = ("< 0.3 (not proposed)", "0.3-0.5", ">= 0.5")


def share_bucket(share: float) -> str:
    return SHARE_BUCKETS[0] if share < 0.3 else SHARE_BUCKETS[1] if share < 0.5 else SHARE_BUCKETS[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--reps", type=int, default=40, help="timed forwards per row count")
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("ar",), weights=args.weights), progress=False)
    codec, model = stack.codec, stack.loaded.model
    prompts = load_prompts(args.data, per_category=args.per_category)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    right = collections.defaultdict(lambda: [0] * 4)  # n -> [positions, >=1, >=2, >=3 right]
    table_hits = collections.defaultdict(lambda: [0, 0])  # share bucket -> [guesses, right]
    misses = 0  # positions context lookup (n >= 2) has nothing for
    total = 0
    for p in tqdm(prompts, desc="answers", unit="prompt"):
        ids = codec.encode_chat([{"role": "user", "content": p.text}])
        out = [t for ev in stack.decoder("ar").generate(ids, params) for t in ev.tokens]
        for j in range(len(out)):
            n, guess = longest_match(ids + out[:j], 3)
            total += 1
            row = right[n]
            row[0] += 1
            for i, tok in enumerate(guess):
                if j + i >= len(out) or tok != out[j + i]:
                    break
                row[i + 1] += 1
            if n < 2 and stack.ngrams is not None:
                misses += 1
                hit = stack.ngrams.guess(ids + out[:j])
                if hit is not None:
                    bucket = share_bucket(hit[1])
                    table_hits[bucket][0] += 1
                    table_hits[bucket][1] += hit[0] == out[j]
    print("| longest match n | share of positions | P(>= 1 right) | P(>= 2) | P(>= 3) |")
    print("|---|---|---|---|---|")
    for n in range(MAX_N, -1, -1):
        row = right[n]
        shares = " | ".join(f"{row[i] / row[0]:.2f}" if n and row[0] else "" for i in (1, 2, 3))
        print(f"| {n or 'none'} | {row[0] / total:.2f} | {shares} |")

    if stack.ngrams is not None and misses:
        print("\n| n-gram table guess, where context lookup has none | share of those positions | right |")
        print("|---|---|---|")
        for bucket in SHARE_BUCKETS:
            guesses, hits = table_hits[bucket]
            print(f"| share {bucket} | {guesses / misses:.2f} | {hits / max(guesses, 1):.2f} |")

    cache = model.new_cache(400)
    prefix = torch.tensor([(ids * 300)[:300]])
    times: dict[int, list[float]] = collections.defaultdict(list)
    with torch.inference_mode():
        model(prefix, torch.arange(300), cache, logits="last")
        for _ in range(args.reps):
            for rows in range(1, 7):
                start = cache.length
                tokens = torch.randint(0, model.cfg.vocab_size, (1, rows))
                mask = torch.ones(rows, rows, dtype=torch.bool).tril() if rows > 1 else None
                t0 = time.perf_counter()
                model(tokens, torch.arange(start, start + rows), cache, tree_mask=mask, logits="all")
                times[rows].append(time.perf_counter() - t0)
                cache.trim(start)
    print("\n| rows | " + " | ".join(str(r) for r in times) + " |")
    print("|---" * (len(times) + 1) + "|")
    print("| ms | " + " | ".join(f"{statistics.median(v) * 1e3:.2f}" for v in times.values()) + " |")


if __name__ == "__main__":
    main()

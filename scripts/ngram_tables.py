"""n-gram table settings, scored where context lookup finds nothing (docs/benchmarks.md, wave 17).

Builds tables (``decoding/ngram_table.py``) from the training side of a ``train-draft`` work
folder's ``generations.jsonl`` (records whose uid hashes outside the lowest 3%), one per setting
of ``--settings`` (ORDER:COUNT:SHARE), beside the model's shipped table, and scores each at every
position where context lookup (n >= 2) has nothing, on (a) the held-out records' answers (first
``--max-new-tokens`` tokens of ``--held-out`` records) and (b) the greedy answers of the int4
target to Spec-Bench prompts (``--per-category`` each): rows a 1- and a 2-token proposal verify
per such position and tokens of them the target accepts.

    .venv/bin/python scripts/ngram_tables.py --work ~/.cache/evospec/train/v5-self \\
        --data ../shared/data/spec_bench/question.jsonl
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from lookup_study import accepted, unmatched

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.ngram_table import NgramTable, load_ngram_table
from evospec.decoding.sampling import SamplingParams
from evospec.models.registry import default_ngrams
from evospec.train.ngram_command import PROMPT_TAIL

SETTINGS = ("4:2:0.3", "4:2:0.2", "4:2:0.4", "4:2:0.5", "6:2:0.3", "4:3:0.3", "4:1:0.3")


def score(table: NgramTable, answers: list[tuple[list[int], list[int]]], k: int) -> tuple[float, float]:
    """(rows proposed, tokens accepted) per position context lookup finds nothing for."""
    misses = rows = taken = 0
    for prompt, out in answers:
        for j, ctx in unmatched(prompt, out):
            misses += 1
            guess = table.propose(ctx, k)
            rows += len(guess)
            taken += accepted(guess, out, j)
    return rows / max(misses, 1), taken / max(misses, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="train-draft's work folder")
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--held-out", type=int, default=150, help="held-out records scored")
    ap.add_argument("--settings", nargs="+", default=SETTINGS, help="ORDER:COUNT:SHARE per table")
    args = ap.parse_args()
    torch.set_num_threads(2)
    stack = assemble(StackSettings(methods=("ar",), weights="int4"), progress=False)
    vocab = stack.loaded.model.cfg.vocab_size
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    bench = []
    for p in load_prompts(args.data, per_category=args.per_category):
        ids = stack.codec.encode_chat([{"role": "user", "content": p.text}])
        bench.append((ids, [t for ev in stack.decoder("ar").generate(ids, params) for t in ev.tokens]))
    with open(args.work.expanduser() / "generations.jsonl", encoding="utf-8") as f:
        recs = [r for r in map(json.loads, f) if not r.get("teacher_forced")]
    held = [r for r in recs if zlib.crc32(r["uid"].encode()) < 0.03 * (1 << 32)]
    held_ids = {r["uid"] for r in held}
    train = [[*r["prompt_ids"][-PROMPT_TAIL:], *r["response_ids"]] for r in recs if r["uid"] not in held_ids]
    held_out = [(r["prompt_ids"], r["response_ids"][: args.max_new_tokens]) for r in held[: args.held_out]]
    print(f"{len(train)} training records ({sum(map(len, train))} tokens), {len(held_out)} held out scored")
    tables = {"shipped": load_ngram_table(default_ngrams(stack.loaded.name), vocab)}
    for spec in args.settings:
        order, count, share = spec.split(":")
        tables[spec] = NgramTable.count(
            train,
            model=stack.loaded.name,
            vocab_size=vocab,
            max_order=int(order),
            min_count=int(count),
            min_share=float(share),
        )
    print("| table | entries | held-out k=2: rows / accepted | Spec-Bench k=1 | Spec-Bench k=2 |")
    print("|---|---|---|---|---|")
    for name, table in tables.items():
        cells = [score(table, held_out, 2), score(table, bench, 1), score(table, bench, 2)]
        row = " | ".join(f"{r:.3f} / {a:.3f}" for r, a in cells)
        print(f"| {name} | {len(table)} | {row} |", flush=True)


if __name__ == "__main__":
    main()

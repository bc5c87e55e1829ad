"""Teacher-forced agreement of EAGLE-2 heads on the target's own answers to benchmark prompts.

Held-out agreement (``scripts/heldout_heads.py``) is measured on training-side answers; live
first-token acceptance on Spec-Bench runs ~0.17 below it. This script splits that gap: it
generates the target's greedy answers to the benchmark's prompts (the same selection as
``evospec bench --per-category N``), caches their features exactly as ``train-draft`` does, and
prints each head's teacher-forced agreement at draft steps 1..3 on them, overall and per
category. If the step-1 figure here matches live first-token acceptance, the gap is the text;
if it is well above it, serving feeds the head something training did not. Used for
docs/draft-head.md (wave 21):

    .venv/bin/python scripts/live_gap.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 4 --max-new-tokens 64 HEAD [HEAD ...]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from evospec.bench.prompts import load_prompts
from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.train.batch_generate import greedy_stream
from evospec.train.trainer import Sequence, TrainConfig, evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="EAGLE-2 head folders")
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or a prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--categories", nargs="+", help="only these prompt categories (default: all)")
    ap.add_argument(
        "--max-len",
        type=int,
        help="keep only each sequence's last N positions, as train-draft does with its max_seq_len "
        "(576): is a long context itself what the head reads worse? (default: the whole sequence)",
    )
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4", help="the target's weight format")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = TrainConfig(steps=3)
    loaded = load_model(args.target, weights=args.weights, progress=False)
    codec = loaded.codec
    prompts = load_prompts(args.data, per_category=args.per_category)
    prompts = [p for p in prompts if not args.categories or p.category in args.categories]
    ids = [
        codec.encode_chat([{"role": "user", "content": p.text}]) if p.chat else codec.encode_text(p.text)
        for p in prompts
    ]
    longest = max(len(i) for i in ids)
    stream = greedy_stream(
        loaded.model,
        ids,
        args.max_new_tokens,
        codec.eos_ids,
        batch_size=8,
        cache_len=longest + args.max_new_tokens + 8,
        features=True,
    )
    by_cat: dict[str, list[Sequence]] = defaultdict(list)
    for done in stream:  # features: every fed position (prompt + answer but its last token)
        prompt = ids[done.index]
        tokens = torch.tensor([*prompt, *done.answer])
        feats = torch.zeros(len(tokens), done.features.shape[1], dtype=torch.float16)
        feats[: len(done.features)] = done.features  # the last row unfed, as train-draft stores it
        lo = max(0, len(tokens) - args.max_len) if args.max_len else 0  # the tail, as load_sequences
        seq = Sequence(tokens[lo:], feats[lo:], max(len(prompt) - lo, 1))
        by_cat[prompts[done.index].category].append(seq)
    seqs = [s for part in by_cat.values() for s in part]
    feat_std = torch.cat([s.features.float() for s in seqs]).std()
    lm_head = loaded.model.lm_head.weight.detach()
    print(f"{len(seqs)} prompts x <= {args.max_new_tokens} answer tokens ({args.data})")
    print("| head | prompts | pairs | step 1 | step 2 | step 3 |\n|---|---|---|---|---|---|")
    for folder in args.heads:
        head = load_eagle(folder).attach(loaded.model)
        for name, part in [("all", seqs), *sorted(by_cat.items())]:
            r = evaluate(head, lm_head, part, feat_std, cfg)
            steps = " | ".join(f"{r[f'top1@{s}']:.3f}" for s in (1, 2, 3))
            print(f"| {folder} | {name} | {r['pairs']:.0f} | {steps} |")


if __name__ == "__main__":
    main()

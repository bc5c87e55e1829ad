"""Held-out agreement of EAGLE-2 heads on a train-draft work folder, by the trainer's own split.

Loads the generated feature shards of ``--work``, splits the sequences as ``train-draft`` does
(``train/trainer.py: split_holdout``: a hash of each sequence, stable as the data grows) and
prints each head's teacher-forced top-1 agreement at draft steps 1..3 (own features from step 2)
over all held-out sequences, over those in shards below ``--first-new-shard`` ("old") and over
those in shards numbered ``--first-new-shard`` and up ("new": the answers a data command added
since an older head was trained: held out from both heads). Used
for docs/draft-head.md, version 6:

    .venv/bin/python scripts/heldout_heads.py --work ~/.cache/evospec/train/v5-self \\
        --first-new-shard 43 OLD_HEAD NEW_HEAD
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.train.datagen import feature_shards
from evospec.train.trainer import TrainConfig, evaluate, load_sequences, split_holdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="EAGLE-2 head folders")
    ap.add_argument("--work", type=Path, required=True, help="train-draft's work folder")
    ap.add_argument("--first-new-shard", type=int, default=0, help="first shard of the newer answers")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4", help="the teacher's weight format")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = TrainConfig(steps=3)
    loaded = load_model(args.target, weights=args.weights, progress=False)
    seqs, old, new = [], [], []
    for shard in feature_shards(args.work.expanduser(), generated=True, teacher=False):
        part = load_sequences([shard], cfg.max_seq_len)
        seqs += part
        (new if int(shard.stem.split("_")[-1]) >= args.first_new_shard else old).extend(part)
    parts = (("all", seqs), ("old", old), ("new", new)) if old and new else (("all", seqs),)
    held = {name: split_holdout(part, cfg.holdout, cfg.seed)[1] for name, part in parts}
    feat_std = torch.cat([s.features[:256].float() for s in seqs[:200]]).std()
    lm_head = loaded.model.lm_head.weight.detach()
    newer = len(held.get("new", ()))
    print(f"held out: {len(held['all'])} sequences, {newer} of them in shards {args.first_new_shard} and up")
    print("| head | held-out set | pairs | step 1 | step 2 | step 3 |\n|---|---|---|---|---|---|")
    for folder in args.heads:
        head = load_eagle(folder).attach(loaded.model)
        for name, hold in held.items():
            r = evaluate(head, lm_head, hold, feat_std, cfg)
            steps = " | ".join(f"{r[f'top1@{s}']:.3f}" for s in (1, 2, 3))
            print(f"| {folder} | {name} | {r['pairs']:.0f} | {steps} |")


if __name__ == "__main__":
    main()

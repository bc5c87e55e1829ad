"""Seconds per draft-head training step at Gemma-3-270M shapes, per soft-CE loss support.

Why: at V = 262,144 the full-vocabulary soft cross-entropy dominates a CPU training step; this
times one optimizer step (forward, backward, AdamW) of a freshly initialised EAGLE-2 head on a
batch of random features for each support, plus the one-off cost of the target's top-k.
Random weights: only the shapes matter for the timing.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/time_loss_support.py [--data-rows 30000]
"""

from __future__ import annotations

import argparse
import time

import torch

from evospec.models.config import ModelConfig
from evospec.models.eagle import new_eagle_for
from evospec.models.transformer import Transformer
from evospec.train.support import topk_support
from evospec.train.trainer import Sequence, TrainConfig, collate, collate_support, pair_losses

GEMMA_270M = dict(
    family="gemma3",
    vocab_size=262_144,
    hidden_size=640,
    intermediate_size=2048,
    num_layers=1,  # only the embedding / LM head and the head's shapes matter here
    num_heads=4,
    num_kv_heads=1,
    head_dim=256,
    max_position_embeddings=32_768,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256.0,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default 64)")
    ap.add_argument("--data-rows", type=int, default=30_000, help="'data' support size (default 30000)")
    ap.add_argument("--modes", default="topk+neg,data,full", help="comma-separated supports")
    ap.add_argument(
        "--unfrozen-target", action="store_true", help="leave the target trainable (the cost before freezing)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    target = Transformer(ModelConfig(**GEMMA_270M)).eval().requires_grad_(not args.unfrozen_target)
    lm_head = target.lm_head.weight.detach()
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4)
    cfg = TrainConfig()
    seqs = [
        Sequence(
            torch.randint(0, 262_144, (args.seq_len,)), torch.randn(args.seq_len, 640).half(), args.prompt_len
        )
        for _ in range(args.batch)
    ]
    tokens, feats, mask = collate(seqs)
    std = feats.std()
    t0 = time.perf_counter()
    for s in seqs:
        s.support_ids, s.support_logp = topk_support(s.features[s.prompt_len :], lm_head, cfg.support_k)
    rows = sum(len(s.features) - s.prompt_len for s in seqs)
    per_tok = (time.perf_counter() - t0) / rows
    print(
        f"threads {torch.get_num_threads()}, pairs per step {int(mask.sum())}, "
        f"batch {args.batch}x{args.seq_len}"
    )
    print(f"one-off target top-{cfg.support_k}: {1e3 * per_tok:.2f} ms per response token")
    for mode in args.modes.split(","):
        kw: dict = {}
        weight = lm_head
        if mode == "data":
            kw["vocab_ids"] = torch.randperm(262_144)[: args.data_rows].sort().values
            weight = lm_head[kw["vocab_ids"]].contiguous()
        times = []
        for _ in range(2 if mode == "full" else 4):
            if mode == "topk+neg":
                kw = {
                    "support": collate_support(seqs),
                    "negatives": torch.randint(0, 262_144, (cfg.negatives,)),
                }
            t0 = time.perf_counter()
            out = pair_losses(head, weight, feats, tokens, mask, std, cfg, train=True, **kw)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        steady = sorted(times[1:])[len(times[1:]) // 2]  # first step warms up
        print(f"{mode:9s} {steady:7.2f} s/step  (cls {float(out['cls'].detach()):.2f})")


if __name__ == "__main__":
    main()

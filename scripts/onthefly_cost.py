"""What one draft-training batch costs with cached features and with features on the fly.

Times, on the machine it runs on, with the default model's shipped head and random
training-mix-like token ids (costs do not depend on the text):
- the target's teacher-forced pass over a batch (tokens/s: the on-the-fly data cost),
- a cached training step (features and the target's top-k read from memory, ``topk+neg``
  loss, as the shipped heads train on a CPU),
- an on-the-fly step (the target's pass, then the full-vocabulary loss),
each the median of ``--repeats`` after one warm-up, at ``--steps`` unrolled draft steps:

    .venv/bin/python scripts/onthefly_cost.py --weights int4 --tokens-per-batch 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.models.registry import DEFAULT_MODEL, default_head
from evospec.train.onthefly import batch_features, token_seq
from evospec.train.support import topk_support
from evospec.train.trainer import Sequence, TrainConfig, collate, collate_support, pair_losses


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(DEFAULT_MODEL, device=args.device, weights=args.weights, progress=False)
    target = loaded.model
    target.requires_grad_(False)
    head = load_eagle(default_head(DEFAULT_MODEL), device=args.device).attach(target)
    head.requires_grad_(True)
    gen = torch.Generator().manual_seed(0)
    rows = args.tokens_per_batch // args.seq_len
    vocab = target.cfg.vocab_size
    seqs = [
        token_seq(
            torch.randint(0, vocab, (args.seq_len // 2,), generator=gen).tolist(),
            torch.randint(0, vocab, (args.seq_len // 2,), generator=gen).tolist(),
            args.seq_len,
        )
        for _ in range(rows)
    ]
    cfg = TrainConfig(steps=args.steps, tokens_per_batch=args.tokens_per_batch)
    lm_head = target.lm_head.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=1e-5)
    tokens, feats, mask, labels = batch_features(target, seqs)
    std = feats.std()

    def forward_only() -> None:
        batch_features(target, seqs)

    def step(loss_args: dict, fresh: bool) -> None:
        t, f, m, lab = batch_features(target, seqs) if fresh else (tokens, feats, mask, labels)
        out = pair_losses(head, lm_head, f, t, m, std, cfg, train=True, labels=lab, **loss_args)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()

    cached = [Sequence(s.tokens, feats[b, : len(s.tokens)].half(), s.prompt_len) for b, s in enumerate(seqs)]
    for s in cached:
        ids, logp = topk_support(s.features[s.prompt_len :].float(), lm_head, 32)
        s.support_ids, s.support_logp = ids, logp
    support = collate_support(cached)
    negatives = torch.randint(0, vocab, (1024,), generator=gen)
    assert torch.equal(collate(cached)[0], tokens)
    n = int(mask.sum())
    t_fwd = timed(forward_only, args.repeats)
    t_cached = timed(lambda: step({"support": support, "negatives": negatives}, fresh=False), args.repeats)
    t_full = timed(lambda: step({}, fresh=False), args.repeats)
    t_fly = timed(lambda: step({}, fresh=True), args.repeats)
    shape = f"{rows} x {args.seq_len} tokens per batch ({n} scored pairs)"
    print(f"{args.weights} target, {shape}, {args.steps} steps, {torch.get_num_threads()} threads:")
    print(f"  target teacher-forced pass  {t_fwd * 1e3:8.0f} ms  {rows * args.seq_len / t_fwd:8.0f} tok/s")
    print(f"  cached step, topk+neg loss  {t_cached * 1e3:8.0f} ms  {n / t_cached:8.0f} pairs/s")
    print(f"  cached step, full loss      {t_full * 1e3:8.0f} ms  {n / t_full:8.0f} pairs/s")
    print(f"  on-the-fly step (full loss) {t_fly * 1e3:8.0f} ms  {n / t_fly:8.0f} pairs/s")


if __name__ == "__main__":
    main()

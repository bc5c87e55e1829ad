"""EAGLE recipe for training a draft head on cached target features.

Owns: the sequence dataset over feature shards, the loss (feature regression + soft
cross-entropy against the target's own next-token distribution, both through the frozen
shared LM head; uniform noise on input features), AdamW with warm-up + cosine decay,
checkpoints with resume, and held-out step-1 agreement. Which vocabulary rows the soft
cross-entropy runs over (all, those seen in the data, or the target's top-k plus sampled
negatives for huge vocabularies) is decided in ``support.py``. Training runs on the target's
device (a GPU when ``train-draft --device`` picks one); the cached sequences stay on the CPU
and move there a batch at a time.

Pair convention (as at inference, see ``decoding/drafter.py``): input i = (feature f_i,
token x_{i+1}); the head's output should equal f_{i+1}, and LM-head(output) should match
the target's distribution for x_{i+2}. Only pairs whose token x_{i+1} belongs to the
response are scored; prompt pairs still serve as attention context.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from evospec.models.eagle import EagleHead
from evospec.models.kv_cache import KVCache
from evospec.models.transformer import Transformer
from evospec.train.support import (
    DEFAULT_K,
    DEFAULT_NEGATIVES,
    dataset_supports,
    full_soft_ce,
    resolve_support,
    sampled_soft_ce,
)


@dataclass
class TrainConfig:
    epochs: int = 4
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    tokens_per_batch: int = 2048
    max_seq_len: int = 576
    noise: float = 0.2  # width of the uniform noise on input features, in units of feature std
    w_reg: float = 1.0  # feature regression weight (EAGLE: v_w)
    w_cls: float = 0.1  # distribution matching weight (EAGLE: p_w)
    grad_clip: float = 0.5
    holdout: float = 0.03  # share of sequences held out for agreement
    # Soft-CE support: "data" (LM-head rows of tokens seen in the data), "full", "topk+neg" (the
    # target's top-k per pair + sampled negatives), "auto" (topk+neg for V >= 128k, else data).
    loss_vocab: str = "auto"
    support_k: int = DEFAULT_K  # topk+neg: the target's top-k ids kept per pair
    negatives: int = DEFAULT_NEGATIVES  # topk+neg: uniform negative ids per step (shared by the batch)
    seed: int = 0


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, D] fp16
    prompt_len: int
    # topk+neg only: the target's top-k at rows prompt_len.. ([T - prompt_len, K] each)
    support_ids: torch.Tensor | None = None  # int32
    support_logp: torch.Tensor | None = None  # float32


def load_sequences(shards: list[Path], max_len: int) -> list[Sequence]:
    from safetensors.torch import load_file

    seqs: list[Sequence] = []
    for shard in shards:
        d = load_file(str(shard))
        start = 0
        for prompt_len, total in d["lengths"].tolist():
            end = start + total
            # Keep the tail of long prompts: the response is what matters.
            lo = max(start, end - max_len)
            seq = Sequence(d["tokens"][lo:end], d["features"][lo:end], max(prompt_len - (lo - start), 1))
            if "support_ids" in d:  # stored at generation time, aligned with the rows
                seq.support_ids = d["support_ids"][lo:end][seq.prompt_len :]
                seq.support_logp = d["support_logp"][lo:end][seq.prompt_len :]
            seqs.append(seq)
            start = end
    return seqs


def split_holdout(seqs: list[Sequence], share: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    rng = random.Random(seed)
    idx = list(range(len(seqs)))
    rng.shuffle(idx)
    n_hold = max(1, int(len(seqs) * share))
    hold = set(idx[:n_hold])
    return [s for i, s in enumerate(seqs) if i not in hold], [s for i, s in enumerate(seqs) if i in hold]


def make_batches(seqs: list[Sequence], tokens_per_batch: int, rng: random.Random) -> list[list[Sequence]]:
    """Length-bucketed batches of about ``tokens_per_batch`` padded tokens, shuffled."""
    order = sorted(seqs, key=lambda s: len(s.tokens))
    batches, cur = [], []
    for s in order:
        if cur and len(s.tokens) * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur = []
        cur.append(s)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T], features [B, T, D] (float32), score mask [B, T-2] for the pairs."""
    t = max(len(s.tokens) for s in batch)
    d = batch[0].features.shape[1]
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    feats = torch.zeros(len(batch), t, d)
    mask = torch.zeros(len(batch), t - 2, dtype=torch.bool)
    for b, s in enumerate(batch):
        n = len(s.tokens)
        tokens[b, :n] = s.tokens
        feats[b, :n] = s.features.float()
        # pair i scores (f_{i+1}, x_{i+2}); keep pairs whose x_{i+1} is a response token.
        lo = max(s.prompt_len - 1, 0)
        mask[b, lo : n - 2] = True
    return tokens, feats, mask


def collate_support(batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k per pair: ids [B, T-2, K] (int64), log-probs [B, T-2, K].

    Pair i is scored against row i + 1; rows before a sequence's prompt_len stay zero (those
    pairs are never scored).
    """
    t = max(len(s.tokens) for s in batch)
    k = batch[0].support_ids.shape[1]
    ids = torch.zeros(len(batch), t, k, dtype=torch.long)
    logp = torch.zeros(len(batch), t, k)
    for b, s in enumerate(batch):
        lo = s.prompt_len
        ids[b, lo : lo + len(s.support_ids)] = s.support_ids.long()
        logp[b, lo : lo + len(s.support_logp)] = s.support_logp
    return ids[:, 1:-1], logp[:, 1:-1]


def head_forward(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Training forward over whole sequences: feats [B, T, D], tokens [B, T] -> [B, T, D]."""
    b, t, _ = feats.shape
    cfg = head.cfg
    cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, t, batch=b, dtype=feats.dtype, device=feats.device)
    return head(feats, tokens, torch.arange(t, device=feats.device), cache, None)


def pair_losses(
    head: EagleHead,
    lm_head: torch.Tensor,
    feats: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    feat_std: torch.Tensor,
    cfg: TrainConfig,
    train: bool,
    vocab_ids: torch.Tensor | None = None,
    support: tuple[torch.Tensor, torch.Tensor] | None = None,
    negatives: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Regression + soft CE + top-1 agreement over the scored pairs.

    ``lm_head`` is [V', D]: the full head, or its rows ``vocab_ids`` ([V']). With ``support``
    (ids and log-probs [B, T-2, K] from ``collate_support``) the CE runs on the target's
    top-k plus ``negatives`` ([M] ids into the full ``lm_head``) instead.
    """
    inp = feats[:, :-2]
    if train and cfg.noise:
        inp = inp + (torch.rand_like(inp) - 0.5) * cfg.noise * feat_std
    out = head_forward(head, inp, tokens[:, 1:-1])  # [B, T-2, D] predicts f_{i+1}
    tgt = feats[:, 1:-1]
    m = mask
    out_m, tgt_m = out[m], tgt[m]  # [N, D]
    reg = F.smooth_l1_loss(out_m / feat_std, tgt_m / feat_std)
    label = tokens[:, 2:][m]  # [N]
    if support is not None:
        neg = negatives if negatives is not None else torch.empty(0, dtype=torch.long, device=out_m.device)
        cls, best = sampled_soft_ce(out_m, lm_head, support[0][m], support[1][m], neg)
    elif train:
        cls, best = full_soft_ce(out_m, tgt_m, lm_head)
    else:  # no graph to keep: bound memory to ~64M logits per chunk of rows
        rows = max(1, (1 << 26) // lm_head.shape[0])
        pieces = [
            full_soft_ce(o, t, lm_head) for o, t in zip(out_m.split(rows), tgt_m.split(rows), strict=True)
        ]
        cls = sum(c * len(b) for c, b in pieces) / max(len(out_m), 1)
        best = torch.cat([b for _, b in pieces])
    if vocab_ids is not None and support is None:
        best = vocab_ids[best]  # compare in target-id space
    top1 = (best == label).float().mean()
    return {"loss": cfg.w_reg * reg + cfg.w_cls * cls, "reg": reg, "cls": cls, "top1": top1}


def train_head(
    head: EagleHead,
    target: Transformer,
    seqs: list[Sequence],
    ckpt_dir: Path,
    cfg: TrainConfig,
    *,
    progress: bool = True,
) -> dict:
    """Train ``head`` in place (resumes from ``ckpt_dir``); returns the metrics log.

    The head ends with the weights of the epoch with the best held-out top-1 agreement. The
    target is frozen first: the head reads its embedding, and a gradient for that [V, D]
    table (unused, never applied) would cost a dense V x D buffer per step.
    """
    target.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train, hold = split_holdout(seqs, cfg.holdout, cfg.seed)
    full_head = target.lm_head.weight.detach()
    device = full_head.device  # the target's (and head's); cached sequences stay on the CPU
    vocab_ids = None
    lm_head = full_head
    mode = resolve_support(cfg.loss_vocab, full_head.shape[0])
    if mode == "data":
        vocab_ids = torch.unique(torch.cat([s.tokens for s in seqs])).to(device)
        lm_head = full_head[vocab_ids].contiguous()
    elif mode == "topk+neg":
        attach_supports(seqs, full_head, cfg.support_k, ckpt_dir, progress=progress)
    all_feats = torch.cat([s.features[:256].float() for s in train[:200]])
    feat_std = all_feats.std().clamp(min=1e-3).to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    epoch_batches = [make_batches(train, cfg.tokens_per_batch, rng) for _ in range(cfg.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg.warmup_steps, total_steps))
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / "trainer.pt"
    run = run_key(seqs, cfg)
    step, log = 0, {"config": asdict(cfg), "loss_support": mode, "epochs": [], "feat_std": float(feat_std)}
    if ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state.get("run") == run:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step, log = state["step"], state["log"]
        else:  # more data or other settings since: resuming would mix two schedules
            tqdm.write(f"{ckpt}: written for other data or settings; training from the start")
    t0 = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc="train-draft", unit="step", disable=not progress)
    done = 0
    for epoch, batches in enumerate(epoch_batches):
        ema: dict[str, float] = {}
        for batch in batches:
            done += 1
            if done <= step:
                continue  # resuming: skip batches already trained
            head.train()
            tokens, feats, mask = (t.to(device) for t in collate(batch))
            if not mask.any():
                continue
            support = negatives = None
            if mode == "topk+neg":
                support = tuple(t.to(device) for t in collate_support(batch))
                negatives = torch.randint(0, full_head.shape[0], (cfg.negatives,), device=device)
            out = pair_losses(
                head,
                lm_head,
                feats,
                tokens,
                mask,
                feat_std,
                cfg,
                train=True,
                vocab_ids=vocab_ids,
                support=support,
                negatives=negatives,
            )
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            for k, v in out.items():
                val = float(v.detach())
                ema[k] = 0.95 * ema.get(k, val) + 0.05 * val
            bar.set_postfix(
                loss=f"{ema['loss']:.3f}", top1=f"{ema['top1']:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}"
            )
            bar.update(1)
        if done <= step and epoch < len(log["epochs"]):
            continue
        agreement = evaluate(head, full_head, hold, feat_std, cfg)
        log["epochs"].append(
            {
                "epoch": epoch,
                "step": step,
                "train_ema": ema,
                "holdout": agreement,
                "seconds": time.perf_counter() - t0,
            }
        )
        if agreement["top1"] >= max((e["holdout"]["top1"] for e in log["epochs"]), default=0.0):
            torch.save(head.state_dict(), ckpt_dir / "best_head.pt")  # early stopping on held-out top-1
            log["best_epoch"] = epoch
        torch.save(
            {
                "head": head.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "step": step,
                "log": log,
                "run": run,
            },
            ckpt,
        )
        (ckpt_dir / "log.json").write_text(json.dumps(log, indent=2))
        tqdm.write(f"epoch {epoch}: holdout top1 {agreement['top1']:.3f} cls {agreement['cls']:.3f}")
    bar.close()
    best = ckpt_dir / "best_head.pt"
    if best.is_file():
        head.load_state_dict(torch.load(best, map_location="cpu", weights_only=True))
    head.eval()
    return log


def attach_supports(
    seqs: list[Sequence], lm_head: torch.Tensor, k: int, ckpt_dir: Path, *, progress: bool = True
) -> None:
    """Give every sequence the target's top-``k`` support at its answer rows.

    Supports stored at generation time are kept (their first ``k`` columns: top-k is sorted);
    sequences from older shards, or stored with fewer than ``k``, get one pass over their
    cached features (``support.dataset_supports``, cached in ``ckpt_dir``).
    """
    for s in seqs:
        if s.support_ids is not None and s.support_ids.shape[1] >= k:
            s.support_ids, s.support_logp = s.support_ids[:, :k], s.support_logp[:, :k]
        else:
            s.support_ids = s.support_logp = None
    need = [s for s in seqs if s.support_ids is None]
    if not need:
        return
    supports = dataset_supports(
        [s.features[s.prompt_len :] for s in need],
        lm_head,
        k,
        ckpt_dir / f"support_top{k}.safetensors",
        progress=progress,
    )
    for s, (ids, logp) in zip(need, supports, strict=True):
        s.support_ids, s.support_logp = ids, logp


def run_key(seqs: list[Sequence], cfg: TrainConfig) -> dict:
    """What a checkpoint must match to be resumed: the data (sequences, lengths) and the config."""
    lengths = json.dumps([(s.prompt_len, int(s.tokens.shape[0])) for s in seqs])
    return {
        "config": asdict(cfg),
        "sequences": len(seqs),
        "lengths_sha1": hashlib.sha1(lengths.encode()).hexdigest(),
    }


@torch.no_grad()
def evaluate(
    head: EagleHead, lm_head: torch.Tensor, seqs: list[Sequence], feat_std: torch.Tensor, cfg: TrainConfig
) -> dict[str, float]:
    """Step-1 agreement on held-out generated sequences (teacher-forced), full vocabulary."""
    head.eval()
    n = tot_top1 = tot_cls = 0.0
    for batch in make_batches(seqs, cfg.tokens_per_batch, random.Random(0)):
        tokens, feats, mask = (t.to(lm_head.device) for t in collate(batch))
        if not mask.any():
            continue
        out = pair_losses(head, lm_head, feats, tokens, mask, feat_std, cfg, train=False)
        k = float(mask.sum())
        n += k
        tot_top1 += float(out["top1"]) * k
        tot_cls += float(out["cls"]) * k
    return {"top1": tot_top1 / max(n, 1), "cls": tot_cls / max(n, 1), "pairs": n}


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

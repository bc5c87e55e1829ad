"""Draft-head training with the target's features computed per batch: no feature cache.

Owns: token-only training sequences (prompt + answer ids, :class:`TokenSeq`), the target's
teacher-forced pass over one batch (its final features, right-padded), a training loop bounded
by epochs and optionally by wall-clock seconds, and held-out agreement per draft step. The
loss, the multi-step unroll and the evaluation are ``trainer.py``'s (``pair_losses``,
``evaluate``); here the soft cross-entropy always runs over the full vocabulary, since the
target's distribution comes for free from the features of the same pass.

Why: a cached feature row costs 2 x D bytes plus its top-k (2.5 GB per million answer tokens
for SmolLM2), while one target prefill over a batch costs less than the head's own training
step on a GPU (on a CPU, about one more cached step: ``scripts/onthefly_cost.py``, where the
full-vocabulary loss is the larger cost). Token ids are all a data stage
has to keep (``generations.jsonl`` already holds them), so the data can grow to tens of
millions of tokens, and each batch's features are exact for the weights that train.

Labels: a sequence marked ``greedy`` (the target's own greedy answer, generated with the same
weights) takes its next token as the target's choice; any other (a dataset's answer) takes the
argmax of the target's logits at each row.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from evospec.models.eagle import EagleHead
from evospec.models.transformer import Transformer
from evospec.train.trainer import Sequence, TrainConfig, evaluate, make_batches, pair_losses, split_holdout


@dataclass
class TokenSeq:
    """One training sequence as token ids only."""

    tokens: torch.Tensor  # [T] int64, prompt then answer
    prompt_len: int
    greedy: bool = True  # the answer is the target's own greedy output (labels = next tokens)


def token_seq(prompt: list[int], answer: list[int], max_len: int, *, greedy: bool = True) -> TokenSeq:
    """``prompt + answer`` cut to its last ``max_len`` tokens (the answer matters; at least one
    prompt token stays, as ``trainer.load_sequences`` keeps cached sequences)."""
    ids = [*prompt, *answer][-max_len:]
    cut = len(prompt) + len(answer) - len(ids)
    return TokenSeq(torch.tensor(ids, dtype=torch.long), max(len(prompt) - cut, 1), greedy)


@torch.inference_mode()
def _target_hidden(target: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The target's final (post-norm) features of right-padded ``tokens`` [B, T] -> [B, T, D].
    Causal attention: the padding after a row's last token changes none of its rows."""
    t = tokens.shape[1]
    out = target(
        tokens, torch.arange(t, device=tokens.device), target.new_cache(t, batch=len(tokens)), logits="none"
    )
    return out.hidden


def batch_features(
    target: Transformer, batch: list[TokenSeq]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One teacher-forced pass over ``batch`` on the target's device.

    Returns tokens [B, T] (int64, zero-padded), features [B, T, D] (float32, ordinary tensors
    that autograd may save), the score mask [B, T-2] of ``trainer.collate`` (pair i scored when
    x_{i+1} is an answer token) and the target's greedy token per pair [B, T-2].
    """
    device = target.device
    t = max(len(s.tokens) for s in batch)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t - 2, dtype=torch.bool)
    for b, s in enumerate(batch):
        n = len(s.tokens)
        tokens[b, :n] = s.tokens
        mask[b, max(s.prompt_len - 1, 0) : n - 2] = True
    tokens, mask = tokens.to(device), mask.to(device)
    hidden = _target_hidden(target, tokens)
    labels = tokens[:, 2:].clone()
    if not all(s.greedy for s in batch):  # dataset answers: the target's argmax at rows 1 .. T-2
        with torch.inference_mode():
            rows = max(1, (1 << 24) // target.cfg.vocab_size)  # bound the logits to ~16M at a time
            flat = hidden[:, 1:-1].reshape(-1, hidden.shape[-1])
            best = torch.cat([target.project_logits(h).argmax(-1) for h in flat.split(rows)])
        taught = torch.tensor([not s.greedy for s in batch], device=device)
        labels = torch.where(taught[:, None], best.view(len(batch), t - 2), labels)
    return tokens, hidden.float().clone(), mask, labels.clone()


def cached_sequences(target: Transformer, seqs: list[TokenSeq], tokens_per_batch: int) -> list[Sequence]:
    """``seqs`` as ``trainer.Sequence`` objects with their features (fp16, on the CPU), for
    ``trainer.evaluate``; the target's greedy labels are kept for dataset answers."""
    out: list[Sequence] = []
    for batch in make_batches(seqs, tokens_per_batch, random.Random(0)):
        _, feats, _, labels = batch_features(target, batch)
        for b, s in enumerate(batch):
            n = len(s.tokens)
            seq = Sequence(s.tokens, feats[b, :n].half().cpu(), s.prompt_len)
            if not s.greedy:  # stored greedy ids start at row prompt_len (pair prompt_len - 1)
                seq.greedy = labels[b, s.prompt_len - 1 : n - 2].cpu()
            out.append(seq)
    return out


@dataclass
class Budget:
    """When on-the-fly training stops: after ``epochs`` over the data or ``seconds`` of training,
    whichever comes first; the learning rate follows the one that is further along."""

    epochs: int = 1
    seconds: float | None = None
    holdout_cap: int = 600  # held-out sequences scored (their features are kept on the CPU)


@dataclass
class _Run:
    """The state one on-the-fly training run carries from batch to batch."""

    head: EagleHead
    target: Transformer
    cfg: TrainConfig
    budget: Budget
    lm_head: torch.Tensor  # [V, D] the target's, frozen
    feat_std: torch.Tensor  # [] scale of the features (noise, regression)
    opt: torch.optim.Optimizer
    total: int  # planned steps over all epochs
    start: float = 0.0  # perf_counter when training began
    step: int = 0
    pairs: int = 0  # scored pairs trained on so far

    def out_of_time(self) -> bool:
        return self.budget.seconds is not None and time.perf_counter() - self.start >= self.budget.seconds

    def train_step(self, batch: list[TokenSeq]) -> dict[str, torch.Tensor] | None:
        """One optimiser step on ``batch`` (None when it has no scored pair); the learning rate
        follows the steps or the seconds, whichever is further along."""
        cfg, elapsed = self.cfg, time.perf_counter() - self.start
        frac = max(self.step / self.total, elapsed / self.budget.seconds if self.budget.seconds else 0.0)
        for g in self.opt.param_groups:
            g["lr"] = cfg.lr * _lr_factor(self.step, cfg.warmup_steps, frac)
        self.head.train()
        tokens, feats, mask, labels = batch_features(self.target, batch)
        if not mask.any():
            return None
        out = pair_losses(
            self.head, self.lm_head, feats, tokens, mask, self.feat_std, cfg, train=True, labels=labels
        )
        self.opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.opt.param_groups for p in g["params"]], cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.pairs += int(mask.sum())
        return out


def train_head_onthefly(
    head: EagleHead,
    target: Transformer,
    seqs: list[TokenSeq],
    cfg: TrainConfig,
    budget: Budget,
    *,
    progress: bool = True,
    on_epoch: Callable[[dict], None] | None = None,
) -> dict:
    """Train ``head`` in place on ``seqs``; returns the log (initial and per-epoch held-out
    agreement by step, train EMAs, throughput). ``head`` ends with its best held-out weights
    (``on_epoch(log)`` runs after each epoch is scored, with the head as that epoch left it)."""
    target.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train, hold = split_holdout(seqs, cfg.holdout, cfg.seed)  # TokenSeq has .tokens: same split
    t0 = time.perf_counter()
    held = cached_sequences(target, hold[: budget.holdout_cap], cfg.tokens_per_batch)
    lm_head = target.lm_head.weight.detach()
    sample = torch.cat([s.features[:256].float() for s in held[:200]])
    feat_std = sample.std().clamp(min=1e-3).to(lm_head.device)  # from held-out rows, fixed
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    epochs = [make_batches(train, cfg.tokens_per_batch, rng) for _ in range(budget.epochs)]
    run = _Run(head, target, cfg, budget, lm_head, feat_std, opt, total=sum(len(e) for e in epochs))
    log: dict = {
        "config": asdict(cfg),
        "budget": asdict(budget),
        "features": "on-the-fly",
        "loss_support": "full",
        "feat_std": float(feat_std),
        "train_sequences": len(train),
        "train_answer_tokens": sum(len(s.tokens) - s.prompt_len for s in train),
        "holdout_sequences": len(held),
        "epochs": [],
    }
    log["initial_holdout"] = evaluate(head, lm_head, held, feat_std, cfg)
    _report("initial", log["initial_holdout"])
    best_top1, best_state = log["initial_holdout"]["top1"], _snapshot(head)
    bar = tqdm(total=run.total, desc="train-draft (on the fly)", unit="step", disable=not progress)
    run.start = time.perf_counter()
    for epoch, batches in enumerate(epochs):
        if epoch and run.out_of_time():
            break  # the time ran out with the last epoch, which was scored already
        ema: dict[str, float] = {}
        for batch in batches:
            if run.out_of_time():
                break
            out = run.train_step(batch)
            if out is None:
                continue
            for k, v in out.items():
                if not k.startswith("n@"):
                    val = float(v.detach())
                    ema[k] = 0.95 * ema.get(k, val) + 0.05 * val
            bar.set_postfix(
                loss=f"{ema['loss']:.3f}", top1=f"{ema['top1']:.3f}", lr=f"{opt.param_groups[0]['lr']:.1e}"
            )
            bar.update(1)
        agreement = evaluate(head, lm_head, held, feat_std, cfg)
        seconds = time.perf_counter() - run.start
        log["epochs"].append(
            {
                "epoch": epoch,
                "step": run.step,
                "scored_pairs": run.pairs,
                "train_ema": ema,
                "holdout": agreement,
                "seconds": round(seconds, 1),
                "pairs_per_second": round(run.pairs / max(seconds, 1e-9), 1),
            }
        )
        _report(f"epoch {epoch}", agreement)
        if agreement["top1"] >= best_top1:
            best_top1, best_state = agreement["top1"], _snapshot(head)
            log["best_epoch"] = epoch
        if on_epoch is not None:
            on_epoch(log)
        if run.out_of_time():
            break
    bar.close()
    head.load_state_dict(best_state)
    head.eval()
    log["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return log


def _snapshot(head: EagleHead) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def _report(what: str, agreement: dict) -> None:
    per_step = " ".join(f"{agreement[k]:.3f}" for k in sorted(agreement) if k.startswith("top1@"))
    tqdm.write(f"{what}: holdout top1 by step {per_step} cls {agreement['cls']:.3f}")


def _lr_factor(step: int, warmup: int, frac: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine to 5% over ``frac`` in [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))

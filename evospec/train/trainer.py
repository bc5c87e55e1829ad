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

Multi-step training (``steps`` S > 1, HASS / EAGLE-3's "training-time test"): step s feeds
pair i the head's own step-(s-1) output at pair i - 1 in place of f_i, as drafting does at
depth s, and attends to what a drafter's cache would hold there: true-feature keys up to pair
i - s + 1 and the step-k keys of pairs i - s + k (k = 2..s) (``step_mask``). Every step is
scored against the same targets, weighted ``step_decay ** (s - 1)``. The agreement label of a
pair is the target's greedy token: the next token for the target's own answers, the top-1 of
the stored support for teacher-forced dataset answers.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
import zlib
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
    restrict_support,
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
    steps: int = 1  # draft steps unrolled on the head's own features (1 = the EAGLE-1 recipe)
    step_decay: float = 0.8  # loss weight of step s: step_decay ** (s - 1)
    eval_steps: int = 3  # held-out agreement is reported for steps 1..max(steps, eval_steps)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.eval_steps < 1:
            raise ValueError(f"train-draft steps must be >= 1, got {self.steps}")
        if not self.step_decay > 0:
            raise ValueError(f"train-draft step decay must be > 0, got {self.step_decay}")
        if self.w_reg < 0 or self.w_cls < 0:
            raise ValueError(f"train-draft loss weights must be >= 0, got reg {self.w_reg}, cls {self.w_cls}")


@dataclass
class Sequence:
    tokens: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, D] fp16
    prompt_len: int
    # topk+neg only: the target's top-k at rows prompt_len.. ([T - prompt_len, K] each)
    support_ids: torch.Tensor | None = None  # int32
    support_logp: torch.Tensor | None = None  # float32
    # the target's greedy token at rows prompt_len.. when it is not the next token (teacher-forced)
    greedy: torch.Tensor | None = None  # [T - prompt_len] int64


def load_sequences(shards: list[Path], max_len: int, aux: list[Path] | None = None) -> list[Sequence]:
    """The cached sequences of ``shards``; with ``aux`` (one aux shard per shard,
    ``aux_features.py``) their features are the fused target layers an EAGLE-3 head reads."""
    from safetensors.torch import load_file

    seqs: list[Sequence] = []
    for i, shard in enumerate(shards):
        d = load_file(str(shard))
        if aux is not None:
            d["features"] = load_file(str(aux[i]))["aux"]  # [rows, 3 D], row for row
        start = 0
        for prompt_len, total in d["lengths"].tolist():
            end = start + total
            # Keep the tail of long prompts: the response is what matters.
            lo = max(start, end - max_len)
            seq = Sequence(d["tokens"][lo:end], d["features"][lo:end], max(prompt_len - (lo - start), 1))
            if "support_ids" in d:  # stored at generation time, aligned with the rows
                seq.support_ids = d["support_ids"][lo:end][seq.prompt_len :]
                seq.support_logp = d["support_logp"][lo:end][seq.prompt_len :]
                seq.greedy = seq.support_ids[:, 0].long()  # top-k is sorted: the target's argmax
            seqs.append(seq)
            start = end
    return seqs


def split_holdout(seqs: list[Sequence], share: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held out): a sequence is held out when a hash of its tokens and ``seed`` falls
    in the lowest ``share`` of the hash range, so the split depends on each sequence alone --
    growing the data (a larger ``--tokens`` into the same work folder) keeps every sequence on
    its side and adds new ones to both. At least one sequence is held out."""
    salt = zlib.crc32(seed.to_bytes(8, "little", signed=True))
    keys = [zlib.crc32(s.tokens.numpy().tobytes(), salt) for s in seqs]  # uniform in [0, 2^32)
    hold = {i for i, key in enumerate(keys) if key < share * (1 << 32)}
    if not hold and seqs:
        hold = {min(range(len(seqs)), key=keys.__getitem__)}
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


def collate_labels(batch: list[Sequence], tokens: torch.Tensor) -> torch.Tensor:
    """The target's greedy token per pair [B, T-2]: x_{i+2}, or the stored greedy id at row
    i + 1 where the sequence has one (teacher-forced answers)."""
    labels = tokens[:, 2:].clone()
    for b, s in enumerate(batch):
        if s.greedy is not None:
            lo = s.prompt_len - 1
            n = min(len(s.greedy), labels.shape[1] - lo)
            labels[b, lo : lo + n] = s.greedy[:n]
    return labels


def step_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Visibility [t, step * t] for draft step ``step`` over pairs 0..t-1: block k (slots
    (k-1)t .. kt) holds the step-k keys; query i sees true keys j <= i - step + 1 (block 1) and,
    for k >= 2, the one step-k key j = i - (step - k)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    blocks = [j <= i - step + 1] + [j == i - (step - k) for k in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


def head_unroll(head: EagleHead, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Outputs of draft steps 1..``steps`` over whole sequences ([B, T, D] each); step s > 1
    consumes step s-1's outputs shifted by one pair, under ``step_mask``."""
    b, t, _ = feats.shape
    cfg = head.cfg
    first = head.fuse(feats[:, :1])  # pair 0's input at every step: the (fused) target feature
    outs: list[torch.Tensor] = []
    prev: KVCache | None = None
    for s in range(1, steps + 1):
        cache = KVCache(
            1, cfg.num_kv_heads, cfg.head_dim, s * t, batch=b, dtype=feats.dtype, device=feats.device
        )
        if prev is None:
            inp, mask = feats, None
        else:  # earlier steps' keys stay as they were written (a fresh cache: no in-place reuse)
            cache.k[:, :, :, : (s - 1) * t] = prev.k
            cache.v[:, :, :, : (s - 1) * t] = prev.v
            cache.length = (s - 1) * t
            inp = torch.cat((first, outs[-1][:, :-1]), dim=1)  # pair i <- step s-1 at i - 1
            mask = step_mask(t, s, feats.device)
        outs.append(head(inp, tokens, torch.arange(t, device=feats.device), cache, mask))
        prev = cache
    return outs


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
    labels: torch.Tensor | None = None,
    steps: int | None = None,
) -> dict[str, torch.Tensor]:
    """Regression + soft CE + top-1 agreement over the scored pairs, for each draft step.

    ``lm_head`` is [V', D]: the full head, or its rows ``vocab_ids`` ([V']). With ``support``
    (ids and log-probs [B, T-2, K] from ``collate_support``) the CE runs on the target's
    top-k plus ``negatives`` ([M] ids into the full ``lm_head``) instead. ``labels`` [B, T-2]:
    the target's greedy token per pair (``collate_labels``; default x_{i+2}). ``steps``
    (default ``cfg.steps``) unrolls the head on its own features; "loss" weights the steps,
    "reg"/"cls"/"top1" are step 1's and "top1@s" step s's agreement.
    """
    steps = steps or cfg.steps
    draft_ids = head.draft_ids() if head.arch == "eagle3" else None  # a reduced (d2t) vocabulary
    if draft_ids is not None and support is not None:  # its LM head's rows: the support in them
        support = restrict_support(support[0], support[1], head.t2d)
    inp = feats[:, :-2]
    if train and cfg.noise:
        inp = inp + (torch.rand_like(inp) - 0.5) * cfg.noise * feat_std
    outs = head_unroll(head, inp, tokens[:, 1:-1], steps)  # each [B, T-2, D], predicts f_{i+1}
    tgt = feats[:, 1:-1]
    labels = tokens[:, 2:] if labels is None else labels
    pair = torch.arange(mask.shape[1], device=mask.device)
    result: dict[str, torch.Tensor] = {}
    total = torch.zeros((), device=feats.device)
    weights = 0.0
    for s, out in enumerate(outs, start=1):
        m = mask & (pair >= s - 1)[None]  # the chain's root, pair i - s + 1, must exist
        if not m.any():
            break
        sup = None if support is None else (support[0][m], support[1][m])
        tgt_m = tgt[m] if head.regresses else None  # EAGLE-3: the token loss only
        reg, cls, best = _step_losses(
            head.logit_input(out[m]), tgt_m, feat_std, lm_head, train, sup, negatives
        )
        if vocab_ids is not None and support is None:
            best = vocab_ids[best]  # compare in target-id space
        elif draft_ids is not None:
            best = draft_ids[best]
        top1 = (best == labels[m]).float().mean()
        w = cfg.step_decay ** (s - 1)
        total = total + w * (cfg.w_reg * reg + cfg.w_cls * cls)
        weights += w
        result[f"top1@{s}"] = top1
        result[f"n@{s}"] = m.sum()
        if s == 1:
            result |= {"reg": reg, "cls": cls, "top1": top1}
    result["loss"] = total / max(weights, 1e-9)
    return result


def _step_losses(
    out_m: torch.Tensor,  # [N, D] what the LM head reads at the scored pairs
    tgt_m: torch.Tensor | None,  # [N, D] the target's features there (None: no regression)
    feat_std: torch.Tensor,
    lm_head: torch.Tensor,
    train: bool,
    support: tuple[torch.Tensor, torch.Tensor] | None,
    negatives: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(regression, soft CE, the head's argmax per pair [N]) for one draft step."""
    reg = out_m.new_zeros(()) if tgt_m is None else F.smooth_l1_loss(out_m / feat_std, tgt_m / feat_std)
    if support is not None:
        neg = negatives if negatives is not None else torch.empty(0, dtype=torch.long, device=out_m.device)
        cls, best = sampled_soft_ce(out_m, lm_head, support[0], support[1], neg)
        if not train:  # agreement counts the head's argmax over the whole vocabulary
            rows = max(1, (1 << 26) // lm_head.shape[0])
            best = torch.cat([(o @ lm_head.T).argmax(-1) for o in out_m.split(rows)])
    elif train:
        cls, best = full_soft_ce(out_m, tgt_m, lm_head)
    else:  # no graph to keep: bound memory to ~64M logits per chunk of rows
        rows = max(1, (1 << 26) // lm_head.shape[0])
        pieces = [
            full_soft_ce(o, t, lm_head) for o, t in zip(out_m.split(rows), tgt_m.split(rows), strict=True)
        ]
        cls = sum(c * len(b) for c, b in pieces) / max(len(out_m), 1)
        best = torch.cat([b for _, b in pieces])
    return reg, cls, best


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
    if head.arch == "eagle3":  # its own LM head, trained on the target's stored top-k
        if any(s.support_ids is None for s in seqs):
            raise ValueError(
                "EAGLE-3 training needs the target's top-k stored with the data (--loss-support topk+neg)"
            )
        mode, lm_head = "topk+neg", head.lm_head.weight
        full_head = lm_head.detach()  # what evaluation projects through
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
    run = run_key(seqs, cfg, head)
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
    if step == 0:  # where training starts from (a random head, or one given to continue from)
        log["initial_holdout"] = evaluate(head, full_head, hold, feat_std, cfg)
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
                labels=collate_labels(batch, tokens),
            )
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            for k, v in out.items():
                if k.startswith("n@"):
                    continue
                val = float(v.detach())
                ema[k] = 0.95 * ema.get(k, val) + 0.05 * val
            bar.set_postfix(
                loss=f"{ema['loss']:.3f}", top1=f"{ema['top1']:.3f}", lr=f"{sched.get_last_lr()[0]:.1e}"
            )
            bar.update(1)
        if done <= step and epoch < len(log["epochs"]):
            continue
        agreement = evaluate(head, full_head, hold, feat_std, cfg)
        for kind, part in (
            ("generated", [s for s in hold if s.greedy is None]),
            ("teacher_forced", [s for s in hold if s.greedy is not None]),
        ):
            if part and len(part) < len(hold):
                agreement[kind] = evaluate(head, full_head, part, feat_std, cfg)
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
        per_step = " ".join(f"{agreement[k]:.3f}" for k in sorted(agreement) if k.startswith("top1@"))
        tqdm.write(f"epoch {epoch}: holdout top1 by step {per_step} cls {agreement['cls']:.3f}")
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


def run_key(seqs: list[Sequence], cfg: TrainConfig, head: EagleHead) -> dict:
    """What a checkpoint must match to be resumed: the data (sequences, lengths), the config and
    the head training starts from (its weights' shapes and values: another ``--init`` or
    ``--widen-mlp`` in the same work folder starts afresh instead of resuming a foreign run)."""
    lengths = json.dumps([(s.prompt_len, int(s.tokens.shape[0])) for s in seqs])
    start = hashlib.sha1()
    for name, t in sorted(head.state_dict().items()):
        start.update(f"{name}{tuple(t.shape)}".encode())
        start.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return {
        "config": asdict(cfg),
        "sequences": len(seqs),
        "lengths_sha1": hashlib.sha1(lengths.encode()).hexdigest(),
        "start_sha1": start.hexdigest(),
    }


@torch.no_grad()
def evaluate(
    head: EagleHead, lm_head: torch.Tensor, seqs: list[Sequence], feat_std: torch.Tensor, cfg: TrainConfig
) -> dict[str, float]:
    """Held-out agreement (teacher-forced, full vocabulary): "top1" at step 1 and "top1@s" for
    steps s = 1..max(steps, eval_steps), the head running on its own features from step 2."""
    head.eval()
    steps = max(cfg.steps, cfg.eval_steps)
    n = tot_cls = 0.0
    hits = [0.0] * (steps + 1)
    counts = [0.0] * (steps + 1)
    for batch in make_batches(seqs, cfg.tokens_per_batch, random.Random(0)):
        tokens, feats, mask = (t.to(lm_head.device) for t in collate(batch))
        if not mask.any():
            continue
        support = None
        if head.arch == "eagle3":  # no target features to take a distribution from: its top-k
            support = tuple(t.to(lm_head.device) for t in collate_support(batch))
        out = pair_losses(
            head,
            lm_head,
            feats,
            tokens,
            mask,
            feat_std,
            cfg,
            train=False,
            labels=collate_labels(batch, tokens),
            steps=steps,
            support=support,
        )
        k = float(mask.sum())
        n += k
        tot_cls += float(out["cls"]) * k
        for s in range(1, steps + 1):
            if f"n@{s}" in out:
                c = float(out[f"n@{s}"])
                counts[s] += c
                hits[s] += float(out[f"top1@{s}"]) * c
    res = {"top1": hits[1] / max(counts[1], 1), "cls": tot_cls / max(n, 1), "pairs": n}
    res |= {f"top1@{s}": hits[s] / max(counts[s], 1) for s in range(1, steps + 1)}
    return res


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

"""Training the two small models the context-dependent baselines need, from cached target features.

Owns: :func:`feature_rows` (answer rows of the cached shards that ``train-draft`` writes:
the target's final post-norm feature of each row, and the row's index in its sequence),
:func:`train_router` (DynaSpec) and :func:`train_selector` (SpecVocab), each returning the
trained module and a JSON-able log with held-out figures before and after training.

The target's next-token distribution at a row is exact and needs no stored labels: it is
softmax(feature @ W.T) with the target's LM head W (the features are post-norm), so both
trainers distil from the full distribution.

- Router (DynaSpec, as NanoSpec re-implements it: an MLP over 256 clusters). Input: the feature
  at row r (the last verified position of a round); target: the clusters' probability mass
  averaged over rows r+1 .. r+S (S = ``horizon``, the tokens the next round drafts); loss: soft
  cross-entropy. Held out: how often the target's greedy tokens at rows r+1 .. r+S fall in the
  clusters the router activates under the id budget, and the mean number of ids active.
- Selector (SpecVocab). Input: a feature standing for the draft's (an EAGLE-2 draft feeds the
  target's LM head features regressed onto the target's); start: the rank-r SVD of W; loss:
  KL(target || softmax(approximate logits)) plus an auxiliary cross-entropy on the target's
  greedy token (the one the candidates must hold). Held out: recall of the greedy token in the
  top ``candidates`` approximate ids, and the target mass those candidates hold.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from evospec.vocab.router import ClusterRouter, budget_prefix
from evospec.vocab.selector import LowRankSelector, svd_selector


@dataclass
class FeatureRows:
    feats: torch.Tensor  # [N, D] fp16 post-norm target features of answer rows
    seq: torch.Tensor  # [N] sequence index of each row
    pos: torch.Tensor  # [N] row index in its sequence
    last: torch.Tensor  # [N] last fed row of that sequence (rows after it have no distribution)


def feature_rows(shards: list[Path], max_rows: int, *, seed: int = 0) -> FeatureRows:
    """The answer rows (prompt_len-1 .. total-2: each has a next token) of whole sequences, from
    the shards in a seeded random order until ``max_rows``; rows of a sequence stay in order."""
    from evospec.train.trainer import load_sequences

    order = list(shards)
    random.Random(seed).shuffle(order)
    feats, seq_ids, pos, last, n = [], [], [], [], 0
    for shard in order:
        for s in load_sequences([shard], max_len=1 << 20):
            lo, hi = s.prompt_len - 1, s.tokens.numel() - 2  # rows with a next token
            if hi < lo:
                continue
            feats.append(s.features[lo : hi + 1])
            seq_ids.append(torch.full((hi - lo + 1,), len(seq_ids), dtype=torch.long))
            pos.append(torch.arange(hi - lo + 1))
            last.append(torch.full((hi - lo + 1,), hi - lo, dtype=torch.long))
            n += hi - lo + 1
        if n >= max_rows:
            break
    if not feats:
        raise ValueError("no answer rows in the cached shards")
    return FeatureRows(torch.cat(feats), torch.cat(seq_ids), torch.cat(pos), torch.cat(last))


def _split(n: int, share: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    hold = max(1, int(n * share))
    return perm[hold:], perm[:hold]


def _cluster_mass(rows: FeatureRows, lm_head: torch.Tensor, clusters: torch.Tensor, progress: bool):
    """[N, C] cluster probability mass of every row's target distribution, and [N] its argmax."""
    n_clusters = int(clusters.max()) + 1
    mass = torch.zeros(rows.feats.shape[0], n_clusters)
    greedy = torch.zeros(rows.feats.shape[0], dtype=torch.long)
    w = lm_head.detach().float()
    for lo in tqdm(range(0, rows.feats.shape[0], 512), desc="target distributions", disable=not progress):
        logits = rows.feats[lo : lo + 512].float() @ w.T  # [b, V]
        greedy[lo : lo + 512] = logits.argmax(-1)
        mass[lo : lo + 512] = torch.zeros(logits.shape[0], n_clusters).index_add_(
            1, clusters, logits.softmax(-1)
        )
    return mass, greedy


def _horizon_targets(
    rows: FeatureRows, mass: torch.Tensor, horizon: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows r with r+1 .. r+horizon in the same sequence: [M] their indices, [M, C] mean mass."""
    ok = torch.nonzero(rows.pos + horizon <= rows.last).flatten()  # rows are consecutive per sequence
    target = torch.stack([mass[ok + j] for j in range(1, horizon + 1)]).mean(0)
    return ok, target


@torch.no_grad()
def _router_eval(router, rows, idx, greedy, clusters, budget, horizon) -> dict:
    sizes = torch.bincount(clusters, minlength=router.clusters)  # [C]
    chosen = budget_prefix(router(rows.feats[idx].float()), sizes, budget)  # [h, C]
    hits = total = 0
    for j in range(1, horizon + 1):
        hits += int(chosen.gather(1, clusters[greedy[idx + j]][:, None]).sum())
        total += idx.numel()
    active = (chosen * sizes).sum(-1).float()
    return {"greedy_covered": round(hits / total, 4), "mean_active": round(float(active.mean()), 1)}


def _fit(opt, train_i: torch.Tensor, loss_of, evaluate, *, epochs, batch, lr, name, progress) -> list[dict]:
    """Epochs of shuffled mini-batches of ``train_i`` under a one-cycle schedule; per epoch the
    mean training loss and ``evaluate()``'s held-out figures."""
    steps = epochs * -(-train_i.numel() // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    out = []
    for epoch in range(epochs):
        perm = train_i[torch.randperm(train_i.numel())]
        total = 0.0
        for lo in tqdm(range(0, perm.numel(), batch), desc=f"{name} epoch {epoch + 1}", disable=not progress):
            b = perm[lo : lo + batch]
            loss = loss_of(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * b.numel()
        with torch.no_grad():
            evaluation = evaluate()
        out.append({"loss": round(total / train_i.numel(), 4), "holdout": evaluation})
        tqdm.write(f"{name} epoch {epoch + 1}: holdout {evaluation}")
    return out


def train_router(
    rows: FeatureRows,
    lm_head: torch.Tensor,
    clusters: torch.Tensor,
    *,
    hidden: int = 1024,
    budget: int = 4096,
    horizon: int = 3,
    epochs: int = 4,
    lr: float = 1e-3,
    batch: int = 512,
    holdout: float = 0.05,
    seed: int = 0,
    progress: bool = True,
) -> tuple[ClusterRouter, dict]:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    mass, greedy = _cluster_mass(rows, lm_head, clusters, progress)
    ok, target = _horizon_targets(rows, mass, horizon)
    train_i, hold_i = _split(ok.numel(), holdout, seed)
    router = ClusterRouter(rows.feats.shape[1], int(clusters.max()) + 1, hidden)
    log = {"rows": int(ok.numel()), "holdout_rows": int(hold_i.numel()), "epochs": []}
    log["initial"] = _router_eval(router, rows, ok[hold_i], greedy, clusters, budget, horizon)

    def loss_of(b: torch.Tensor) -> torch.Tensor:  # b [n] indices into ok: soft CE on the cluster mass
        return -(target[b] * torch.log_softmax(router(rows.feats[ok[b]].float()), -1)).sum(-1).mean()

    opt = torch.optim.AdamW(router.parameters(), lr=lr, weight_decay=0.01)
    log["epochs"] = _fit(
        opt,
        train_i,
        loss_of,
        lambda: _router_eval(router, rows, ok[hold_i], greedy, clusters, budget, horizon),
        epochs=epochs,
        batch=batch,
        lr=lr,
        name="router",
        progress=progress,
    )
    log["seconds"] = round(time.perf_counter() - t0, 1)
    return router.eval().requires_grad_(False), log


@torch.no_grad()
def _selector_eval(selector, rows, idx, w, candidates) -> dict:
    hits, mass, n = 0, 0.0, 0
    for lo in range(0, idx.numel(), 512):
        x = rows.feats[idx[lo : lo + 512]].float()
        p = (x @ w.T).softmax(-1)  # [b, V]
        cand = torch.topk(selector(x), candidates, dim=-1).indices  # [b, K]
        hits += int((cand == p.argmax(-1, keepdim=True)).any(-1).sum())
        mass += float(p.gather(1, cand).sum())
        n += x.shape[0]
    return {"greedy_recall": round(hits / n, 4), "mass": round(mass / n, 4)}


def train_selector(
    rows: FeatureRows,
    lm_head: torch.Tensor,
    *,
    rank: int = 64,
    candidates: int = 2048,
    epochs: int = 2,
    lr: float = 2e-3,
    batch: int = 256,
    aux_weight: float = 0.5,
    holdout: float = 0.05,
    seed: int = 0,
    progress: bool = True,
) -> tuple[LowRankSelector, dict]:
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    w = lm_head.detach().float()
    selector = svd_selector(w, rank)
    train_i, hold_i = _split(rows.feats.shape[0], holdout, seed)
    log = {"rows": int(rows.feats.shape[0]), "holdout_rows": int(hold_i.numel()), "epochs": []}
    log["svd"] = _selector_eval(selector, rows, hold_i, w, candidates)

    def loss_of(b: torch.Tensor) -> torch.Tensor:  # b [n] rows: KL to the target + CE on its greedy token
        x = rows.feats[b].float()
        with torch.no_grad():
            logits = x @ w.T  # [n, V] exact
            p, greedy = logits.softmax(-1), logits.argmax(-1)
        logq = torch.log_softmax(selector(x), -1)
        return -(p * logq).sum(-1).mean() + aux_weight * nn.functional.nll_loss(logq, greedy)

    opt = torch.optim.Adam(selector.parameters(), lr=lr)
    log["epochs"] = _fit(
        opt,
        train_i,
        loss_of,
        lambda: _selector_eval(selector, rows, hold_i, w, candidates),
        epochs=epochs,
        batch=batch,
        lr=lr,
        name="selector",
        progress=progress,
    )
    log["seconds"] = round(time.perf_counter() - t0, 1)
    return selector.eval().requires_grad_(False), log

"""Loss supports for huge vocabularies: auto choice, top-k support cache, sampled soft CE."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evospec.models.eagle import new_eagle_for
from evospec.train import support as sup
from evospec.train.support import (
    dataset_supports,
    full_soft_ce,
    resolve_support,
    sampled_soft_ce,
    topk_support,
)
from evospec.train.trainer import TrainConfig, evaluate, train_head
from tests.decoding.spec_helpers import tiny_target
from tests.train.test_trainer import make_sequences


def test_auto_support_depends_on_vocabulary_size() -> None:
    assert resolve_support("auto", 262_144) == "topk+neg"
    assert resolve_support("auto", 131_072) == "topk+neg"
    assert resolve_support("auto", 49_152) == "data"
    assert resolve_support("full", 262_144) == "full"
    with pytest.raises(ValueError, match="unknown loss support"):
        resolve_support("topk", 10)


def test_topk_support_is_the_normalised_top_k_in_any_chunking() -> None:
    g = torch.Generator().manual_seed(0)
    feats, w = torch.randn(7, 16, generator=g), torch.randn(50, 16, generator=g)
    ids, logp = topk_support(feats.half(), w, 5, rows=3)
    ref = torch.log_softmax(feats.half().float() @ w.T, -1).topk(5)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref.indices)
    assert torch.allclose(logp, ref.values, atol=1e-5)
    ids2, logp2 = topk_support(feats.half(), w, 5, rows=100)
    assert torch.equal(ids, ids2) and torch.allclose(logp, logp2)


def _problem(v: int, d: int, n: int, sharp: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, d, generator=g) / d**0.5
    tgt = torch.randn(n, d, generator=g) * sharp
    out = (tgt + 0.5 * sharp * torch.randn(n, d, generator=g)).requires_grad_(True)
    return w, tgt, out


def test_sampled_loss_equals_full_loss_when_the_support_covers_the_vocabulary() -> None:
    v = 40
    w, tgt, out = _problem(v, 8, 6, sharp=3.0)
    ids, logp = topk_support(tgt, w, v)  # K = V: every id in every row's support
    full, full_best = full_soft_ce(out, tgt, w)
    (g_full,) = torch.autograd.grad(full, out)
    for negatives in (torch.empty(0, dtype=torch.long), torch.randint(0, v, (25,))):
        loss, best = sampled_soft_ce(out, w, ids.long(), logp, negatives)  # negatives all clash
        (g,) = torch.autograd.grad(loss, out)
        assert torch.allclose(loss, full, atol=1e-5)
        assert torch.allclose(g, g_full, atol=1e-5)
        assert torch.equal(best, full_best)


def test_sampled_loss_follows_the_full_gradient_on_a_peaked_target() -> None:
    """K 32 of V 4096 plus 512 negatives: near-equal loss, gradient pointing the same way."""
    v = 4096
    w, tgt, out = _problem(v, 32, 64, sharp=6.0, seed=1)
    ids, logp = topk_support(tgt, w, 32)
    assert logp.exp().sum(-1).mean() > 0.8, "target should be peaked for this check"
    full, _ = full_soft_ce(out, tgt, w)
    (g_full,) = torch.autograd.grad(full, out)
    torch.manual_seed(0)
    losses, grads = [], []
    for _ in range(8):
        loss, _ = sampled_soft_ce(out, w, ids.long(), logp, torch.randint(0, v, (512,)))
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, out)[0])
    g = torch.stack(grads).mean(0)
    cos = torch.nn.functional.cosine_similarity(g.flatten(), g_full.flatten(), dim=0)
    assert cos > 0.95, float(cos)
    assert abs(float(torch.stack(losses).mean()) - float(full.detach())) < 0.15 * float(full.detach())
    # Without negatives the tail is ignored: the estimate is far worse.
    no_neg, _ = sampled_soft_ce(out, w, ids.long(), logp, torch.empty(0, dtype=torch.long))
    (g0,) = torch.autograd.grad(no_neg, out)
    cos0 = torch.nn.functional.cosine_similarity(g0.flatten(), g_full.flatten(), dim=0)
    assert cos0 < cos


def test_dataset_supports_are_cached_and_recomputed_on_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(30, 8, generator=g)
    feats = [torch.randn(n, 8, generator=g) for n in (3, 5, 4)]
    cache = tmp_path / "support.safetensors"
    first = dataset_supports(feats, w, 4, cache, progress=False)
    assert cache.is_file() and [i.shape for i, _ in first] == [(3, 4), (5, 4), (4, 4)]

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("cached supports must not be recomputed")

    with monkeypatch.context() as m:
        m.setattr(sup, "topk_support", boom)
        again = dataset_supports(feats, w, 4, cache, progress=False)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    other = dataset_supports(feats, w, 6, cache, progress=False)  # another k: recomputed
    assert other[0][0].shape == (3, 6)


def test_training_with_topk_negatives_lowers_loss_and_raises_agreement(tmp_path: Path) -> None:
    target = tiny_target(0, sharp=4.0)
    seqs = make_sequences(target)
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(
        epochs=6,
        lr=3e-3,
        warmup_steps=2,
        tokens_per_batch=256,
        holdout=0.2,
        noise=0.05,
        loss_vocab="topk+neg",
        support_k=8,
        negatives=16,
    )
    std = torch.cat([s.features.float() for s in seqs]).std()
    lm_head = target.lm_head.weight.detach()
    before = evaluate(head, lm_head, seqs, std, cfg)
    log = train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    after = evaluate(head, lm_head, seqs, std, cfg)  # full vocabulary
    assert log["loss_support"] == "topk+neg"
    assert (tmp_path / "ckpt" / "support_top8.safetensors").is_file()
    assert after["cls"] < before["cls"] - 0.1
    assert after["top1"] > before["top1"] + 0.15


def test_negatives_carry_the_tail_for_an_untrained_head() -> None:
    """Head output unrelated to the target: its mass sits outside the support, and only the
    negatives' partition estimate pushes it down (gradient close to the full one)."""
    v, d = 4096, 32
    g = torch.Generator().manual_seed(1)
    w = torch.randn(v, d, generator=g) / d**0.5
    tgt = torch.randn(64, d, generator=g) * 6
    out = (torch.randn(64, d, generator=g) * 6).requires_grad_(True)
    ids, logp = topk_support(tgt, w, 32)
    full, _ = full_soft_ce(out, tgt, w)
    (g_full,) = torch.autograd.grad(full, out)
    torch.manual_seed(0)
    loss, _ = sampled_soft_ce(out, w, ids.long(), logp, torch.randint(0, v, (512,)))
    (g_neg,) = torch.autograd.grad(loss, out)
    no_neg, _ = sampled_soft_ce(out, w, ids.long(), logp, torch.empty(0, dtype=torch.long))
    (g_none,) = torch.autograd.grad(no_neg, out)
    cos = torch.nn.functional.cosine_similarity
    assert cos(g_neg.flatten(), g_full.flatten(), dim=0) > 0.7
    assert cos(g_none.flatten(), g_full.flatten(), dim=0) < 0.6
    assert abs(float(loss.detach()) - float(full.detach())) < 0.2 * float(full.detach())
    assert float(no_neg.detach()) < 0.6 * float(full.detach())  # the tail's share is missing


def test_train_draft_flags() -> None:
    from evospec.cli import build_parser

    args = build_parser().parse_args(["train-draft", "--out", "x"])
    assert (args.loss_support, args.support_k, args.negatives) == ("auto", 32, 1024)
    args = build_parser().parse_args(
        ["train-draft", "--out", "x", "--loss-support", "topk+neg", "--support-k", "8", "--negatives", "64"]
    )
    assert (args.loss_support, args.support_k, args.negatives) == ("topk+neg", 8, 64)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-draft", "--out", "x", "--loss-support", "topk"])

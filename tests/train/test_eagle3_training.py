"""EAGLE-3 training: aux features of cached shards, the unrolled token loss, agreement rises."""

from __future__ import annotations

import pytest
import torch

from evospec.models.eagle3 import load_eagle3, new_eagle3_for, save_eagle3
from evospec.train.aux_features import aux_dir, write_aux_features
from evospec.train.datagen import feature_shards
from evospec.train.trainer import TrainConfig, evaluate, load_sequences, train_head
from tests.decoding.spec_helpers import tiny_target
from tests.train.test_trainer import generate_tiny


def tiny_data(tmp_path, target, n=24):
    """The tiny target's answers with their top-8 supports, and their aux features (layers 0, 1, 1)."""
    generate_tiny(target, tmp_path, n, support_k=8, shard_tokens=400, max_new_tokens=32, cache_len=96)
    shards = feature_shards(tmp_path)
    layers = (0, 1, 1)
    aux = write_aux_features(target, tmp_path, layers, progress=False)
    return shards, aux, layers


def tiny_config(**kw) -> TrainConfig:
    """The EAGLE-3 recipe at tiny scale: token loss on the stored top-8 plus sampled negatives."""
    base = dict(
        epochs=5,
        lr=3e-3,
        warmup_steps=2,
        tokens_per_batch=256,
        holdout=0.25,
        noise=0.0,
        loss_vocab="topk+neg",
        support_k=8,
        negatives=16,
        steps=3,
        w_reg=0.0,
    )
    return TrainConfig(**(base | kw))


def trainable_head(target, layers):
    head = new_eagle3_for(target, aux_layers=layers)
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def test_aux_shards_hold_the_target_layers_row_for_row(tmp_path):
    target = tiny_target(3)
    shards, aux, layers = tiny_data(tmp_path, target, n=6)
    assert [a.name for a in aux] == [s.name for s in shards] and aux[0].parent == aux_dir(tmp_path, layers)
    seqs = load_sequences(shards, 100, aux)
    s = seqs[0]
    with torch.inference_mode():
        out = target(
            s.tokens[None],
            torch.arange(len(s.tokens)),
            target.new_cache(len(s.tokens)),
            logits="none",
            aux_layers=layers,
        )
    want = torch.cat(out.aux_hidden, dim=-1)[0]
    assert s.features.shape == want.shape and torch.allclose(s.features.float(), want, atol=1e-2)
    stamp = aux[0].stat().st_mtime_ns
    write_aux_features(target, tmp_path, layers, progress=False)  # done shards are kept
    assert aux[0].stat().st_mtime_ns == stamp


def test_eagle3_training_raises_agreement_and_saves_the_public_layout(tmp_path):
    target = tiny_target(0, sharp=4.0)
    shards, aux, layers = tiny_data(tmp_path / "work", target)
    seqs = load_sequences(shards, 100, aux)
    head = trainable_head(target, layers)
    cfg = tiny_config()
    std = torch.ones(())
    before = evaluate(head, head.lm_head.weight.detach(), seqs, std, cfg)
    log = train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    after = evaluate(head, head.lm_head.weight.detach(), seqs, std, cfg)
    assert after["top1"] > before["top1"] + 0.1
    assert after["top1@2"] > before["top1@2"]
    assert log["loss_support"] == "topk+neg" and len(log["epochs"]) == cfg.epochs
    save_eagle3(head, tmp_path / "h")
    back = load_eagle3(tmp_path / "h")
    assert back.aux_layers == layers and back.lm_head.weight.dtype == torch.float32


def test_eagle3_training_needs_stored_supports(tmp_path):
    target = tiny_target(0)
    shards, aux, layers = tiny_data(tmp_path, target, n=6)
    seqs = load_sequences(shards, 100, aux)
    for s in seqs:
        s.support_ids = s.support_logp = None
    head = new_eagle3_for(target, aux_layers=layers)
    with pytest.raises(ValueError, match="top-k"):
        train_head(head, target, seqs, tmp_path / "ckpt", TrainConfig(epochs=1), progress=False)


def test_a_reduced_vocabulary_sees_the_targets_support_renormalised():
    from evospec.train.support import restrict_support, sampled_soft_ce

    in_draft = torch.tensor([False, True, True, False, True])  # target ids 1, 2, 4 -> rows 0, 1, 2
    ids = torch.tensor([[4, 0, 1], [3, 0, 3]])
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1]]))
    slots, rlogp = restrict_support(ids, logp, in_draft)
    assert slots[0].tolist() == [2, 0, 0] and rlogp[0, 1] == float("-inf")
    assert torch.allclose(rlogp[0, [0, 2]].exp(), torch.tensor([0.5, 0.1]) / 0.6)
    assert torch.isinf(rlogp[1]).all()  # nothing covered: no loss for that row
    out = torch.randn(2, 4, requires_grad=True)
    rows = torch.randn(3, 4)
    loss, _ = sampled_soft_ce(out, rows, slots, rlogp, torch.empty(0, dtype=torch.long))
    z = out[0] @ rows[[2, 0]].T  # the kept entries; the dropped one is neither mass nor partition
    p = torch.tensor([0.5, 0.1]) / 0.6
    want = -(p * (z - torch.logsumexp(z, 0))).sum() / 2  # the mean over both rows, the second adds 0
    assert torch.allclose(loss, want) and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(out.grad).all() and out.grad[1].abs().sum() == 0


def test_a_draft_vocabulary_head_trains_on_the_ids_the_target_predicts(tmp_path):
    """--draft-vocab: the K ids the target predicts most often (EOS included) become the head's
    rows (d2t/t2d); training on the restricted support raises agreement in target-id space."""
    from evospec.train.command import frequent_targets

    target = tiny_target(0, sharp=4.0)
    shards, aux, layers = tiny_data(tmp_path / "work", target)
    seqs = load_sequences(shards, 100, aux)
    ids = frequent_targets(seqs, 24, target.cfg.vocab_size, always=(63,))
    counts = torch.bincount(torch.cat([s.greedy for s in seqs]), minlength=64)
    assert len(ids) == 24 and 63 in ids.tolist() and ids.tolist() == sorted(ids.tolist())
    left_out = [i for i in range(64) if i not in ids.tolist()]
    assert counts[left_out].max() <= counts[[i for i in ids.tolist() if i != 63]].min()
    head = new_eagle3_for(target, aux_layers=layers, draft_ids=ids)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = tiny_config()
    before = evaluate(head, head.lm_head.weight.detach(), seqs, torch.ones(()), cfg)
    train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    after = evaluate(head, head.lm_head.weight.detach(), seqs, torch.ones(()), cfg)
    assert after["top1"] > before["top1"] + 0.1
    save_eagle3(head, tmp_path / "h")
    back = load_eagle3(tmp_path / "h")
    assert torch.equal(back.draft_ids(), ids) and back.lm_head.weight.shape[0] == 24

"""On-the-fly draft training: per-batch target features equal the cached path's, training
raises held-out agreement, and the wall-clock budget stops it."""

from __future__ import annotations

import pytest
import torch

from evospec.models.eagle import new_eagle_for
from evospec.train.batch_generate import greedy_batch
from evospec.train.onthefly import Budget, batch_features, cached_sequences, token_seq, train_head_onthefly
from evospec.train.trainer import Sequence, TrainConfig, collate, collate_labels
from tests.decoding.spec_helpers import prompt_of, tiny_target


def token_seqs(target, n: int = 24, greedy: bool = True):
    prompts = [prompt_of(100 + i, 6 + i % 5) for i in range(n)]
    answers = greedy_batch(target, prompts, 40, (), batch_size=8, cache_len=64)
    return [token_seq(p, a, 576, greedy=greedy) for p, a in zip(prompts, answers, strict=True)]


def trainable(target):
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def test_token_seq_keeps_the_answer_and_one_prompt_token():
    s = token_seq([1, 2, 3, 4], [7, 8, 9], max_len=5)
    assert s.tokens.tolist() == [3, 4, 7, 8, 9] and s.prompt_len == 2
    s = token_seq([1, 2], [7, 8, 9, 10, 11], max_len=4)
    assert s.tokens.tolist() == [8, 9, 10, 11] and s.prompt_len == 1


def test_batch_features_equal_one_sequence_forwards():
    target = tiny_target(0, sharp=4.0)
    seqs = token_seqs(target, 6)
    tokens, feats, mask, labels = batch_features(target, seqs)  # right-padded, one forward
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        with torch.inference_mode():
            ref = target(s.tokens[None], torch.arange(n), target.new_cache(n), logits="none").hidden[0]
        assert torch.allclose(feats[b, :n], ref, atol=1e-5)
    cached = [
        Sequence(s.tokens, torch.zeros(len(s.tokens), 1, dtype=torch.float16), s.prompt_len) for s in seqs
    ]
    ref_tokens, _, ref_mask = collate(cached)  # the cached path's layout, same order
    assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask)
    assert torch.equal(labels, tokens[:, 2:])  # greedy answers: the next token is the target's choice


def test_dataset_answers_are_labelled_with_the_targets_argmax():
    target = tiny_target(0, sharp=4.0)
    seqs = token_seqs(target, 4)
    wrong = [token_seq(s.tokens[: s.prompt_len].tolist(), [9] * 12, 576, greedy=False) for s in seqs]
    tokens, feats, _, labels = batch_features(target, [*seqs[:2], *wrong[:2]])
    ref = target.project_logits(feats[2:, 1:-1]).argmax(-1)
    assert torch.equal(labels[2:], ref) and torch.equal(labels[:2], tokens[:2, 2:])
    cached = cached_sequences(target, wrong, 10_000)
    lab = collate_labels(cached, collate(cached)[0])
    assert (lab != 9).any()  # the stored greedy labels replace the dataset's tokens


def test_training_raises_heldout_agreement_per_step():
    target = tiny_target(0, sharp=4.0)
    seqs = token_seqs(target, 30)
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, tokens_per_batch=256, holdout=0.2, noise=0.05, steps=2)
    log = train_head_onthefly(trainable(target), target, seqs, cfg, Budget(epochs=6), progress=False)
    first, last = log["initial_holdout"], log["epochs"][-1]["holdout"]
    assert last["top1@1"] > first["top1@1"] + 0.15 and last["top1@2"] > first["top1@2"]
    assert last["cls"] < first["cls"] - 0.1
    assert len(log["epochs"]) == 6 and log["holdout_sequences"] >= 1
    assert log["train_answer_tokens"] > 0 and log["epochs"][-1]["pairs_per_second"] > 0


def test_time_budget_stops_training_early():
    target = tiny_target(0, sharp=4.0)
    seqs = token_seqs(target, 30)
    cfg = TrainConfig(tokens_per_batch=128, holdout=0.2)
    log = train_head_onthefly(
        trainable(target), target, seqs, cfg, Budget(epochs=50, seconds=0.0), progress=False
    )
    assert len(log["epochs"]) == 1 and log["epochs"][0]["step"] == 0


@pytest.mark.gpu
def test_onthefly_training_on_cuda():
    """The GPU path: grouped-prefill generation, per-batch features and training on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target = tiny_target(0, sharp=4.0).cuda()
    seqs = token_seqs(target, 30)  # greedy_batch prefills refills grouped on CUDA
    cfg = TrainConfig(lr=3e-3, warmup_steps=2, tokens_per_batch=256, holdout=0.2, noise=0.05, steps=2)
    head = trainable(target).cuda()
    log = train_head_onthefly(head, target, seqs, cfg, Budget(epochs=6), progress=False)
    assert log["epochs"][-1]["holdout"]["top1@1"] > log["initial_holdout"]["top1@1"] + 0.15

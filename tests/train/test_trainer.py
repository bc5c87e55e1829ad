"""Draft-head training: a few steps lower the loss and raise step-1 agreement; resume works."""

from __future__ import annotations

import json

import pytest
import torch

from evospec.models.eagle import load_eagle, new_eagle_for, save_eagle, widen_mlp
from evospec.train.batch_generate import greedy_batch
from evospec.train.datagen import feature_shards, generate_responses
from evospec.train.trainer import (
    Sequence,
    TrainConfig,
    collate,
    evaluate,
    load_sequences,
    split_holdout,
    train_head,
)
from tests.decoding.spec_helpers import prompt_of, tiny_target


def make_sequences(target, n: int = 24) -> list[Sequence]:
    prompts = [prompt_of(100 + i, 6) for i in range(n)]
    answers = greedy_batch(target, prompts, 40, (), batch_size=8, cache_len=64)
    seqs = []
    dev = target.embed_tokens.weight.device
    with torch.inference_mode():
        for p, a in zip(prompts, answers, strict=True):
            ids = torch.tensor([p + a], device=dev)
            hid = target(
                ids, torch.arange(ids.shape[1], device=dev), target.new_cache(ids.shape[1]), logits="none"
            ).hidden[0]
            seqs.append(Sequence(ids[0].cpu(), hid.half().cpu(), len(p)))  # cached on the CPU, as on disk
    return seqs


def test_holdout_split_keeps_each_sequence_on_its_side_as_data_grows():
    def seq(i: int) -> Sequence:
        tokens = torch.tensor([i, i * 7 + 3, 11, i % 5])
        return Sequence(tokens, torch.zeros(4, 2, dtype=torch.float16), prompt_len=1)

    first, grown = [seq(i) for i in range(400)], [seq(i) for i in range(1200)]
    held = {int(s.tokens[0]) for s in split_holdout(first, 0.1, seed=0)[1]}
    train_grown, held_grown = split_holdout(grown[::-1], 0.1, seed=0)  # more data, another order
    held_grown_ids = {int(s.tokens[0]) for s in held_grown}
    assert held == {i for i in held_grown_ids if i < 400}  # old sequences stay on their side
    assert 60 <= len(held_grown) <= 180  # ~10% of 1,200
    assert len(train_grown) + len(held_grown) == 1200
    assert {int(s.tokens[0]) for s in split_holdout(first, 0.1, seed=1)[1]} != held  # the seed matters
    assert len(split_holdout(first[:3], 0.001, seed=0)[1]) == 1  # never an empty held-out set


def test_collate_scores_only_response_pairs():
    s = Sequence(torch.arange(10), torch.zeros(10, 4, dtype=torch.float16), prompt_len=4)
    tokens, feats, mask = collate([s])
    # pair i is scored when x_{i+1} is a response token: i >= 3, and i <= T - 3
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 5, 6, 7]
    assert tokens.shape == (1, 10) and feats.dtype == torch.float32


def test_training_lowers_loss_and_raises_agreement(tmp_path):
    target = tiny_target(0, sharp=4.0)
    seqs = make_sequences(target)
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(epochs=6, lr=3e-3, warmup_steps=2, tokens_per_batch=256, holdout=0.2, noise=0.05)
    std = torch.cat([s.features.float() for s in seqs]).std()
    before = evaluate(head, target.lm_head.weight.detach(), seqs, std, cfg)
    log = train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    after = evaluate(head, target.lm_head.weight.detach(), seqs, std, cfg)
    assert after["cls"] < before["cls"] - 0.1
    assert after["top1"] > before["top1"] + 0.15
    assert len(log["epochs"]) == cfg.epochs
    assert (
        json.loads((tmp_path / "ckpt" / "log.json").read_text())["epochs"][-1]["step"]
        == log["epochs"][-1]["step"]
    )
    # A rerun resumes from the checkpoint: nothing left to train, same weights.
    again = new_eagle_for(target)
    for p in again.parameters():
        p.requires_grad_(True)
    train_head(again, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    for k, v in head.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    save_eagle(head, tmp_path / "head")
    assert load_eagle(tmp_path / "head").fc.weight.dtype == torch.float32


def test_checkpoint_of_other_data_is_not_resumed(tmp_path):
    target = tiny_target(0, sharp=4.0)
    seqs = make_sequences(target, n=12)
    cfg = TrainConfig(epochs=1, lr=3e-3, warmup_steps=1, tokens_per_batch=256, holdout=0.2)

    def fresh():
        head = new_eagle_for(target)
        for p in head.parameters():
            p.requires_grad_(True)
        return head

    train_head(fresh(), target, seqs[:8], tmp_path / "ckpt", cfg, progress=False)
    # Grown data (as after a larger --tokens): a new run, not a resume that skips every batch.
    log = train_head(fresh(), target, seqs, tmp_path / "ckpt", cfg, progress=False)
    alone = train_head(fresh(), target, seqs, tmp_path / "other", cfg, progress=False)
    assert log["epochs"][-1]["step"] == alone["epochs"][-1]["step"] > 0
    assert len(log["epochs"]) == 1


def test_checkpoint_of_another_starting_head_is_not_resumed(tmp_path):
    """Same data and config, another head to start from (another --init, or --widen-mlp): a new
    run, neither the finished run's weights nor a shape error."""
    target = tiny_target(0, sharp=4.0)
    seqs = make_sequences(target, n=8)
    cfg = TrainConfig(epochs=1, lr=3e-3, warmup_steps=1, tokens_per_batch=256, holdout=0.2)
    heads = [new_eagle_for(target, seed=s) for s in (0, 1)]
    heads.append(widen_mlp(heads[0], 2 * heads[0].cfg.intermediate_size))
    logs = []
    for head in heads:
        for p in head.parameters():
            p.requires_grad_(True)
        logs.append(train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False))
    assert all(log["epochs"][-1]["step"] > 0 and "initial_holdout" in log for log in logs)
    assert not torch.equal(heads[0].fc.weight, heads[1].fc.weight)
    assert heads[2].layers[0].mlp.down_proj.weight.shape[1] == 2 * heads[0].cfg.intermediate_size


def generate_tiny(target, work, n: int, **kw) -> int:
    """The target answers ``n`` numbered prompts into ``work`` (EOS id 5, up to 9 tokens each)."""
    from evospec.train.prompts import TrainPrompt

    prompts = [TrainPrompt(f"x:{i}", "x", str(i)) for i in range(n)]
    opts = dict(target_tokens=10_000, batch_size=3, max_new_tokens=9, cache_len=64, progress=False)
    return generate_responses(
        target, lambda p: prompt_of(int(p.text), 4 + int(p.text)), (5,), prompts, work, **(opts | kw)
    )


def test_generated_shards_hold_teacher_forced_features(tmp_path):
    target = tiny_target(1)
    encode = {f"x:{i}": prompt_of(i, 4 + i) for i in range(7)}

    def run(**kw) -> int:
        return generate_tiny(target, tmp_path, 7, **kw)

    have = run(shard_tokens=30)
    shards = feature_shards(tmp_path)
    assert len(shards) >= 2
    recs = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert sorted(r["uid"] for r in recs) == sorted(encode) and have == sum(
        len(r["response_ids"]) for r in recs
    )
    seqs = load_sequences(shards, max_len=100)
    by_prompt = {tuple(s.tokens[: s.prompt_len].tolist()): s for s in seqs}
    for r in recs:
        s = by_prompt[tuple(r["prompt_ids"])]
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        assert torch.equal(s.tokens, ids[0])
        with torch.inference_mode():
            hid = target(
                ids, torch.arange(ids.shape[1]), target.new_cache(ids.shape[1]), logits="none"
            ).hidden[0]
        assert torch.allclose(s.features[:-1].float(), hid[:-1], atol=1e-2)
    # Resuming with everything done generates nothing more.
    again = run()
    assert again == have and feature_shards(tmp_path) == shards


def test_generation_stores_the_targets_topk_support(tmp_path, monkeypatch):
    from evospec.train import trainer
    from evospec.train.support import topk_support

    target = tiny_target(1)
    generate_tiny(target, tmp_path / "work", 5, support_k=8)
    seqs = load_sequences(feature_shards(tmp_path / "work"), max_len=100)
    for s in seqs:
        ids = s.tokens[None]
        with torch.inference_mode():
            hid = target(
                ids, torch.arange(ids.shape[1]), target.new_cache(ids.shape[1]), logits="none"
            ).hidden[0]
        ref_ids, ref_logp = topk_support(hid[s.prompt_len : -1], target.lm_head.weight, 8)  # fed rows
        assert s.support_ids.shape == (len(s.tokens) - s.prompt_len, 8)
        got_ids, got_logp = s.support_ids[: len(ref_ids)], s.support_logp[: len(ref_ids)]
        assert torch.allclose(got_logp, ref_logp, atol=1e-4)
        assert all(set(a.tolist()) == set(b.tolist()) for a, b in zip(got_ids, ref_ids, strict=True))

    # topk+neg training reads them (top 4 of the stored 8) instead of a pass over the features.
    def no_pass(*a, **kw):
        raise AssertionError("supports were recomputed")

    monkeypatch.setattr(trainer, "dataset_supports", no_pass)
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(
        epochs=1, warmup_steps=1, tokens_per_batch=256, holdout=0.2, loss_vocab="topk+neg", support_k=4
    )
    log = train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    assert log["loss_support"] == "topk+neg" and all(s.support_ids.shape[1] == 4 for s in seqs)


@pytest.mark.gpu
@pytest.mark.parametrize("support", ["data", "topk+neg"])
def test_training_on_cuda_matches_the_cpu_recipe(tmp_path, support):
    """The same recipe on a GPU: cached sequences stay on the CPU, the head and loss on CUDA."""
    target = tiny_target(0, sharp=4.0).cuda()
    seqs = make_sequences(target)
    head = new_eagle_for(target)
    for p in head.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(
        epochs=6, lr=3e-3, warmup_steps=2, tokens_per_batch=256, holdout=0.2, noise=0.05, loss_vocab=support
    )
    std = torch.cat([s.features.float() for s in seqs]).std().cuda()
    before = evaluate(head, target.lm_head.weight.detach(), seqs, std, cfg)
    train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    after = evaluate(head, target.lm_head.weight.detach(), seqs, std, cfg)
    assert next(head.parameters()).is_cuda
    assert after["cls"] < before["cls"] - 0.1 and after["top1"] > before["top1"] + 0.15
    save_eagle(head, tmp_path / "head")  # written from CUDA tensors
    assert load_eagle(tmp_path / "head").fc.weight.device.type == "cpu"


def test_interrupted_generation_keeps_its_finished_answers(tmp_path, monkeypatch):
    from evospec.train import datagen
    from evospec.train.batch_generate import greedy_stream

    target = tiny_target(1)

    def two_then_ctrl_c(*a, **kw):
        stream = greedy_stream(*a, **kw)
        yield next(stream)
        yield next(stream)
        raise KeyboardInterrupt

    monkeypatch.setattr(datagen, "greedy_stream", two_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        generate_tiny(target, tmp_path, 6)
    lines = (tmp_path / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 2 and len(load_sequences(feature_shards(tmp_path), 100)) == 2


def test_attach_supports_keeps_stored_and_fills_the_rest(tmp_path):
    from evospec.train.support import topk_support
    from evospec.train.trainer import attach_supports

    target = tiny_target(0)
    seqs = make_sequences(target, n=3)
    lm = target.lm_head.weight.detach()
    ref = [topk_support(s.features[s.prompt_len :], lm, 4) for s in seqs]
    seqs[0].support_ids, seqs[0].support_logp = topk_support(seqs[0].features[seqs[0].prompt_len :], lm, 6)
    seqs[1].support_ids, seqs[1].support_logp = topk_support(seqs[1].features[seqs[1].prompt_len :], lm, 2)
    attach_supports(seqs, lm, 4, tmp_path, progress=False)
    for s, (ids, logp) in zip(seqs, ref, strict=True):
        assert torch.equal(s.support_ids, ids) and torch.allclose(s.support_logp, logp)
    assert (tmp_path / "support_top4.safetensors").is_file()  # the two recomputed ones, cached

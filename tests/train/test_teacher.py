"""Teacher-forced draft data and multi-step training: the prefill pass stores what generation
stores, the greedy label is the target's, and the unrolled training forward computes what
drafting computes at depth s."""

from __future__ import annotations

import json

import pytest
import torch

from evospec.common import DEFAULT_DATA
from evospec.models.eagle import new_eagle_for
from evospec.train.conversations import TrainConversation, training_conversations
from evospec.train.datagen import feature_shards, teacher_force
from evospec.train.trainer import (
    Sequence,
    TrainConfig,
    collate,
    collate_labels,
    head_unroll,
    load_sequences,
    step_mask,
    train_head,
)
from tests.decoding.spec_helpers import tiny_target
from tests.train.test_trainer import generate_tiny


def _as_conversations(recs: list[dict]) -> tuple[list[TrainConversation], dict[str, tuple[list, list]]]:
    convs = [TrainConversation(r["uid"], "x", ({"role": "user", "content": r["uid"]},), "") for r in recs]
    return convs, {r["uid"]: (r["prompt_ids"], r["response_ids"]) for r in recs}


def test_teacher_forcing_stores_what_generation_stores(tmp_path):
    target = tiny_target(1)
    generate_tiny(target, tmp_path / "gen", 6, support_k=8)
    recs = [json.loads(x) for x in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    convs, ids = _as_conversations(recs)
    have = teacher_force(
        target, lambda c: ids[c.uid], convs, tmp_path / "tf", target_tokens=10_000, support_k=8,
        batch_tokens=40, shard_tokens=25, progress=False,
    )  # fmt: skip
    assert have == sum(len(r["response_ids"]) for r in recs)
    gen = {tuple(s.tokens.tolist()): s for s in load_sequences(feature_shards(tmp_path / "gen"), 100)}
    taught = load_sequences(feature_shards(tmp_path / "tf", generated=False), 100)
    assert len(taught) == len(gen) and len(feature_shards(tmp_path / "tf")) >= 2
    for s in taught:
        g = gen[tuple(s.tokens.tolist())]
        assert s.prompt_len == g.prompt_len
        assert torch.allclose(s.features.float(), g.features.float(), atol=1e-2)
        assert torch.allclose(s.support_logp, g.support_logp, atol=1e-3)
        # greedy answers: the target's top-1 at every fed answer row is the next token
        assert torch.equal(s.greedy[:-1], s.tokens[s.prompt_len + 1 :])  # the last row is never fed
    again = teacher_force(
        target,
        lambda c: ids[c.uid],
        convs,
        tmp_path / "tf",
        target_tokens=10_000,
        support_k=8,
        progress=False,
    )
    assert again == have  # resumed: nothing left to do


def test_labels_are_the_targets_greedy_tokens_not_the_datasets():
    s = Sequence(torch.arange(10), torch.zeros(10, 4, dtype=torch.float16), prompt_len=4)
    s.greedy = torch.tensor([90, 91, 92, 93, 94, 95])  # rows 4..9
    tokens = collate([s])[0]
    labels = collate_labels([s], tokens)
    # pair i scores row i + 1's next token: pairs 0..2 keep x_{i+2}, pairs 3.. take greedy[i - 3]
    assert labels[0].tolist() == [2, 3, 4, 90, 91, 92, 93, 94]


def test_step_mask_is_what_a_drafter_sees():
    m = step_mask(5, 3)  # [5, 15]: true keys, step-2 keys, step-3 keys
    # query 4 at step 3: chain root pair 2; true keys 0..2, step-2 key of pair 3, its own key
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert step_mask(4, 1).equal(torch.ones(4, 4).tril().bool())


def test_unrolled_training_forward_equals_drafting(tmp_path):
    target = tiny_target(2)
    head = new_eagle_for(target, seed=3)
    torch.manual_seed(0)
    feats = torch.randn(2, 9, target.cfg.hidden_size)
    tokens = torch.randint(0, target.cfg.vocab_size, (2, 9))
    with torch.no_grad():
        outs = head_unroll(head, feats, tokens, 3)
        for root in (0, 3, 5):
            cache = head.new_cache(16)
            cache.k = cache.k.expand(-1, 2, -1, -1, -1).clone()
            cache.v = cache.v.expand(-1, 2, -1, -1, -1).clone()
            out = head(feats[:, : root + 1], tokens[:, : root + 1], torch.arange(root + 1), cache, None)[
                :, -1:
            ]
            assert torch.allclose(out[:, 0], outs[0][:, root], atol=1e-5)
            for depth in (2, 3):  # a chain: each step appends one pair that sees everything before it
                pos = root + depth - 1
                mask = torch.ones(1, cache.length + 1, dtype=torch.bool)
                out = head(out, tokens[:, pos : pos + 1], torch.tensor([pos]), cache, mask)
                assert torch.allclose(out[:, 0], outs[depth - 1][:, pos], atol=1e-5), (root, depth)


def test_multi_step_training_logs_agreement_per_step(tmp_path):
    from tests.train.test_trainer import make_sequences

    target = tiny_target(0, sharp=4.0)
    seqs = make_sequences(target, n=12)
    head = new_eagle_for(target)
    head.requires_grad_(True)
    cfg = TrainConfig(epochs=2, lr=3e-3, warmup_steps=1, tokens_per_batch=256, holdout=0.25, steps=2)
    log = train_head(head, target, seqs, tmp_path / "ckpt", cfg, progress=False)
    last = log["epochs"][-1]
    assert {"top1@1", "top1@2", "top1@3"} <= set(last["holdout"]) and "top1@2" in last["train_ema"]
    assert last["holdout"]["top1@1"] == last["holdout"]["top1"]
    assert set(log["initial_holdout"]) == set(last["holdout"])  # the starting point, measured alike


@pytest.mark.skipif(not (DEFAULT_DATA / "gsm8k").is_dir(), reason="needs the shared data folder")
def test_training_conversations_come_from_training_sets_only():
    convs = training_conversations(DEFAULT_DATA)
    sources = {c.source for c in convs}
    assert sources == {"oasst", "gsm8k_train", "self_instruct", "t0_sample", "translation"}
    assert all(c.history[-1]["role"] == "user" and c.answer.strip() for c in convs)
    gsm = next(c for c in convs if c.source == "gsm8k_train")
    assert "<<" not in gsm.answer and "The answer is" in gsm.answer
    assert any(len(c.history) > 1 for c in convs if c.source == "oasst")  # multi-turn histories
    test_q = {json.loads(x)["question"] for x in (DEFAULT_DATA / "gsm8k/test.jsonl").read_text().splitlines()}
    assert not any(c.history[0]["content"] in test_q for c in convs)
    with pytest.raises(ValueError, match="evaluation"):
        training_conversations(DEFAULT_DATA / "spec_bench")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"steps": 0}, "steps must be >= 1"),
        ({"step_decay": 0.0}, "step decay must be > 0"),
        ({"w_reg": -1.0}, "loss weights"),
    ],
)
def test_bad_training_settings_are_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)


def test_bad_step_flags_are_a_clear_cli_error(capsys) -> None:
    from evospec.cli import main

    argv = ["train-draft", "--steps", "2", "--step-decay", "-1", "--out", "x", "--no-progress"]
    assert main([*argv, "--target", "/nonexistent-model"]) == 2  # refused before the model is looked for
    assert "step decay must be > 0, got -1.0" in capsys.readouterr().err

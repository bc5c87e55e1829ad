"""Training the DynaSpec router and the SpecVocab selector from cached features: both learn,
their logs say what they reach, and ``evospec train-vocab`` adds them to an index directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evospec.train.vocab_models import FeatureRows, feature_rows, train_router, train_selector
from indices.clusters import spherical_kmeans

V, D = 64, 16


def _rows(weight: torch.Tensor, seqs: int = 60, length: int = 12, seed: int = 0) -> FeatureRows:
    """Sequences whose rows all point at one token's LM-head row: the next rows' distributions
    (and so the clusters the router must pick) are a function of the current feature."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, V, (seqs,), generator=gen)
    feats = weight[toks].repeat_interleave(length, 0) * 3 + 0.05 * torch.randn(
        seqs * length, D, generator=gen
    )
    seq = torch.arange(seqs).repeat_interleave(length)
    pos = torch.arange(length).repeat(seqs)
    return FeatureRows(feats.half(), seq, pos, torch.full_like(seq, length - 1))


def test_router_learns_which_clusters_come_next() -> None:
    torch.manual_seed(0)
    weight = torch.randn(V, D)
    clusters = torch.as_tensor(spherical_kmeans(weight, 8))
    router, log = train_router(
        _rows(weight), weight, clusters, hidden=64, budget=24, epochs=12, batch=32, lr=1e-2, progress=False
    )
    final = log["epochs"][-1]["holdout"]
    assert final["greedy_covered"] > max(0.8, log["initial"]["greedy_covered"] + 0.2)
    assert final["mean_active"] <= 24  # the budget bounds the active ids
    assert router.clusters == 8 and not any(p.requires_grad for p in router.parameters())


def test_selector_beats_its_svd_start_at_recalling_the_greedy_token() -> None:
    torch.manual_seed(0)
    weight = torch.randn(V, D)
    rows = _rows(weight, seqs=120, length=4)
    sel, log = train_selector(rows, weight, rank=2, candidates=4, epochs=8, lr=1e-2, batch=64, progress=False)
    assert log["epochs"][-1]["holdout"]["greedy_recall"] > log["svd"]["greedy_recall"] + 0.1
    assert log["epochs"][-1]["loss"] < log["epochs"][0]["loss"]
    assert sel.rank == 2


def test_feature_rows_keep_answer_rows_of_whole_sequences(tmp_path: Path) -> None:
    from evospec.train.datagen import feature_shards
    from tests.decoding.spec_helpers import tiny_target
    from tests.train.test_trainer import generate_tiny

    target = tiny_target(0, sharp=4.0)
    generate_tiny(target, tmp_path, 6, shard_tokens=100, max_new_tokens=12, cache_len=48)
    rows = feature_rows(feature_shards(tmp_path), max_rows=10_000)
    assert rows.feats.shape[1] == target.cfg.hidden_size and rows.feats.dtype == torch.float16
    # per sequence: consecutive positions 0..last, all rows with a next token
    for s in rows.seq.unique():
        pos = rows.pos[rows.seq == s]
        assert pos.tolist() == list(range(int(rows.last[rows.seq == s][0]) + 1))


@pytest.mark.parametrize("kind", ["dynaspec", "specvocab"])
def test_train_vocab_adds_a_file_the_policy_loads(tmp_path: Path, kind: str, default_model) -> None:
    from evospec.cli import main
    from evospec.vocab.factory import make_policy
    from indices.manifest import load_indices

    data = tmp_path / "conv.jsonl"
    talk = [
        ("Name three colours.", "Red, green and blue are three colours."),
        ("What is two plus two?", "Two plus two is four."),
        ("Say hello in French.", "Bonjour! That is hello in French."),
    ]
    data.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            for q, a in talk
        )
    )
    out, work = tmp_path / "idx", tmp_path / "work"
    args = [
        kind,
        "--out",
        str(out),
        "--work",
        str(work),
        "--data",
        str(data),
        "--rows",
        "500",
        "--epochs",
        "1",
    ]
    args += ["--rank", "16"] if kind == "specvocab" else ["--hidden", "32"]
    assert main(["train-vocab", *args, "--no-progress"]) == 0
    bundle = load_indices(out, default_model.model.lm_head.weight, need_hnsw=False)
    name = f"{kind}.safetensors"
    record = bundle.manifest.extras[name]
    assert record["command"].startswith("evospec train-vocab") and record["train_log"]["rows"] > 10
    policy = make_policy(kind, default_model.model.cfg.vocab_size, indices=bundle)
    assert policy.name == kind

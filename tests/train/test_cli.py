"""`evospec train-draft` end to end on a tiny model folder (no shared data, no real model)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from evospec.cli import main
from evospec.models.eagle import load_eagle
from evospec.tokenizer import TextCodec
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for, write_model_folder

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    base = tiny_codec(CORPUS.split("\n\n") * 4)
    codec = TextCodec(base.tok, TEMPLATE, base.special)
    texts = [line for line in CORPUS.replace(". ", ".\n").splitlines() if line.strip()]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    return write_model_folder(tmp_path / "model", tiny_model_for(codec, 0), codec)


def _argv(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    argv = ["train-draft", "--target", str(model), "--work", str(tmp_path / "work")]
    argv += ["--data", str(tmp_path / "prompts.jsonl")]
    return [*argv, "--tokens", "60", "--max-new-tokens", "12", "--batch-size", "4", "--no-progress", *extra]


def test_generate_only_grows_the_cache_and_a_later_run_trains(model: Path, tmp_path: Path) -> None:
    assert main(_argv(model, tmp_path, "--generate-only")) == 0
    lines = (tmp_path / "work" / "generations.jsonl").read_text().splitlines()
    assert sum(len(json.loads(x)["response_ids"]) for x in lines) >= 60
    assert not (tmp_path / "work" / "ckpt").exists()  # no training happened

    out = tmp_path / "head"
    assert main(_argv(model, tmp_path, "--out", str(out), "--epochs", "1", "--device", "cpu")) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["response_tokens"] >= 60 and info["sequences"] == len(lines)  # nothing regenerated
    assert info["features"] == "cached"
    assert len(info["train_log"]["epochs"]) == 1
    assert load_eagle(out).fc.weight.shape[0] > 0


def test_widen_mlp_continues_a_head_with_a_wider_mlp(model: Path, tmp_path: Path, capsys) -> None:
    """--widen-mlp grows the --init head before training; the saved head keeps the width; without
    --init (or for EAGLE-3) it is refused before anything loads."""
    first, wide = tmp_path / "head", tmp_path / "wide"
    common = ["--epochs", "1", "--device", "cpu"]
    assert main(_argv(model, tmp_path, "--out", str(first), *common)) == 0
    inter = load_eagle(first).cfg.intermediate_size
    argv = _argv(model, tmp_path, "--out", str(wide), "--init", str(first), *common)
    assert main([*argv, "--widen-mlp", str(2 * inter)]) == 0
    grown = load_eagle(wide)
    assert grown.layers[0].mlp.down_proj.weight.shape[1] == 2 * inter
    assert json.loads((wide / "config.json").read_text())["intermediate_size"] == 2 * inter
    for extra in (["--widen-mlp", "64"], ["--widen-mlp", "64", "--init", str(first), "--arch", "eagle3"]):
        assert main(_argv(model, tmp_path, "--out", str(wide), *extra)) == 2
        assert "--widen-mlp N grows an EAGLE-2 head given as --init" in capsys.readouterr().err


def test_skip_prompts_answers_only_the_rest_of_the_mix(model: Path, tmp_path: Path, capsys) -> None:
    from evospec.train.prompts import training_prompts

    mix = [p.uid for p in training_prompts(tmp_path / "prompts.jsonl")]
    assert main([*_argv(model, tmp_path, "--generate-only", "--skip-prompts", "3"), "--tokens", "10000"]) == 0
    lines = (tmp_path / "work" / "generations.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["uid"] for x in lines) == sorted(mix[3:])  # each of the rest, once
    with pytest.raises(SystemExit) as bad:  # refused by the parser, before the model loads
        main(_argv(model, tmp_path, "--generate-only", "--skip-prompts", "-1"))
    assert bad.value.code == 2 and "--skip-prompts: must be >= 0" in capsys.readouterr().err


def test_sources_and_prompt_length_pick_what_is_answered(model: Path, tmp_path: Path, capsys) -> None:
    long = " ".join(["the cat sat on the mat"] * 12)
    (tmp_path / "docs.jsonl").write_text(
        json.dumps({"prompt": long}) + "\n" + json.dumps({"prompt": "a dog"})
    )
    argv = [
        *_argv(model, tmp_path, "--generate-only"),
        "--data",
        str(tmp_path / "prompts.jsonl"),
        str(tmp_path / "docs.jsonl"),
    ]
    assert main([*argv, "--sources", "docs", "--max-prompt-tokens", "8", "--tokens", "10000"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "work" / "generations.jsonl").read_text().splitlines()]
    assert [r["uid"] for r in lines] == ["docs:1"]  # only that source; the long prompt is skipped
    assert main([*argv, "--sources", "docs", "--max-prompt-tokens", "200", "--tokens", "10000"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "work" / "generations.jsonl").read_text().splitlines()]
    assert sorted(r["uid"] for r in lines) == ["docs:0", "docs:1"] and len(lines[-1]["prompt_ids"]) > 8
    assert main([*argv, "--sources", "doc"]) == 2
    assert "unknown prompt source(s) ['doc']" in capsys.readouterr().err


def test_training_needs_an_output_folder(model: Path, tmp_path: Path, capsys) -> None:
    assert main(_argv(model, tmp_path)) == 2
    assert "--out" in capsys.readouterr().err


def test_evaluation_sets_are_refused_as_training_data(model: Path, tmp_path: Path, capsys) -> None:
    bench = tmp_path / "humaneval" / "prompts.jsonl"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"prompt": "def f():"}))
    assert main([*_argv(model, tmp_path, "--generate-only"), "--data", str(bench)]) == 2
    assert "evaluation sets must not be used for training" in capsys.readouterr().err


def test_auto_device_is_cuda_only_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from evospec.models.loading import resolve_device

    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:1")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"


def test_a_bad_device_is_a_clear_error(model: Path, tmp_path: Path, capsys) -> None:
    assert main(_argv(model, tmp_path, "--generate-only", "--device", "tpu0")) == 2
    assert "unknown device 'tpu0'" in capsys.readouterr().err


def test_sigterm_becomes_a_clean_exit() -> None:
    import os
    import signal
    import time

    from evospec.common import stop_cleanly_on_sigterm

    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a job started with `cmd &`
        stop_cleanly_on_sigterm()
        flushed = []
        with pytest.raises(SystemExit) as exc:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler interrupts this
            finally:
                flushed.append(True)
        assert exc.value.code == 128 + signal.SIGTERM and flushed == [True]
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)


def test_teacher_forced_conversations_train_a_head_from_another(model: Path, tmp_path: Path) -> None:
    convs = tmp_path / "convs.jsonl"
    texts = [line for line in CORPUS.replace(". ", ".\n").splitlines() if line.strip()]
    recs = [
        {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
        for a, b in itertools.pairwise(texts)
    ]
    convs.write_text("\n".join(json.dumps(r) for r in recs))
    first = tmp_path / "first"
    argv = ["train-draft", "--target", str(model), "--work", str(tmp_path / "w1"), "--data", str(convs)]
    argv += ["--source", "dataset", "--dataset-tokens", "40", "--epochs", "1", "--no-progress"]
    assert main([*argv, "--out", str(first)]) == 0
    info = json.loads((first / "training.json").read_text())
    assert (
        info["source"] == "dataset" and info["response_tokens"] == 0 and info["teacher_forced_tokens"] >= 40
    )
    second = tmp_path / "second"
    argv[argv.index(str(tmp_path / "w1"))] = str(tmp_path / "w2")
    assert main([*argv, "--out", str(second), "--init", str(first), "--steps", "2", "--epochs", "1"]) == 0
    info = json.loads((second / "training.json").read_text())
    assert info["init"] == str(first) and info["train_log"]["config"]["steps"] == 2
    assert "top1@2" in info["train_log"]["epochs"][-1]["holdout"]


def test_bad_conversation_records_are_refused(model: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    argv = ["train-draft", "--target", str(model), "--work", str(tmp_path / "w"), "--data", str(bad)]
    assert main([*argv, "--source", "dataset", "--generate-only", "--no-progress"]) == 2
    assert "must end with a user and an assistant message" in capsys.readouterr().err


def test_a_quantised_teacher_keeps_its_data_in_its_own_folder(
    model: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    from evospec.models.quant import kernels_available

    if not kernels_available("int8"):
        pytest.skip("torch without CPU int8 kernels")
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path / "home"))
    argv = [a for a in _argv(model, tmp_path) if a not in ("--work", str(tmp_path / "work"))]
    out = tmp_path / "head"
    assert main([*argv, "--weights", "int8", "--out", str(out), "--epochs", "1", "--device", "cpu"]) == 0
    folders = [p.name for p in (tmp_path / "home" / "train").iterdir()]
    assert folders == ["model+int8"]  # fp32 teachers' data (train/model) is never mixed in
    assert json.loads((out / "training.json").read_text())["teacher_weights"] == "int8"
    from evospec.kernels.prefetch import available

    if available():  # its answers decode with the machine's weight prefetch, measured and cached
        assert "weight prefetch: " in capsys.readouterr().err
        assert (tmp_path / "home" / "tuning" / "prefetch.json").is_file()


def test_an_eagle3_head_with_a_draft_vocabulary_end_to_end(model: Path, tmp_path: Path, capsys) -> None:
    from evospec.models.eagle3 import load_eagle3

    out = tmp_path / "e3"
    argv = _argv(model, tmp_path, "--arch", "eagle3", "--loss-support", "topk+neg", "--epochs", "1")
    assert main([*argv, "--draft-vocab", "30", "--out", str(out)]) == 2  # the tied LM head has no rows
    assert "--lm-head own" in capsys.readouterr().err
    assert main([*argv, "--lm-head", "own", "--draft-vocab", "30", "--out", str(out)]) == 0
    head = load_eagle3(out)
    assert head.draft_vocab == 30 and head.draft_ids() is not None
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 30


def test_on_the_fly_keeps_token_ids_only_and_trains_from_them(model: Path, tmp_path: Path) -> None:
    argv = _argv(model, tmp_path, "--features", "on-the-fly")
    assert main([*argv, "--generate-only"]) == 0
    work = tmp_path / "work"
    recs = [json.loads(x) for x in (work / "generations.jsonl").read_text().splitlines()]
    assert sum(len(r["response_ids"]) for r in recs) >= 60 and all(r["shard"] is None for r in recs)
    assert not list(work.glob("features/shard_*.safetensors"))  # no feature cache on disk

    out = tmp_path / "head"
    assert main([*argv, "--out", str(out), "--epochs", "2", "--device", "cpu"]) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["features"] == "on-the-fly" and info["sequences"] == len(recs)
    assert info["train_log"]["loss_support"] == "full" and len(info["train_log"]["epochs"]) == 2
    assert {"top1@1", "top1@2", "top1@3"} <= set(info["train_log"]["epochs"][-1]["holdout"])
    assert load_eagle(out).fc.weight.shape[0] > 0


def test_on_the_fly_reads_dataset_answers_without_a_data_stage(model: Path, tmp_path: Path) -> None:
    convs = tmp_path / "chats.jsonl"
    convs.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            for q, a in itertools.product(["the cat sat", "a dog ran"], ["on the mat today", "far away"])
        )
    )
    out = tmp_path / "head"
    argv = ["train-draft", "--target", str(model), "--work", str(tmp_path / "work"), "--data", str(convs)]
    argv += ["--source", "dataset", "--features", "on-the-fly", "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--no-progress", "--device", "cpu"]) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["teacher_forced_tokens"] > 0 and info["response_tokens"] == 0 and info["sequences"] == 4
    assert not (tmp_path / "work" / "teacher").exists()  # nothing cached


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--features", "on-the-fly", "--arch", "eagle3"], "--features on-the-fly trains EAGLE-2 heads"),
        (["--features", "on-the-fly", "--loss-support", "topk+neg"], "full distribution"),
        (["--train-seconds", "5"], "--train-seconds bounds on-the-fly training"),
    ],
)
def test_on_the_fly_refuses_what_it_cannot_do(model: Path, tmp_path: Path, capsys, extra, message) -> None:
    assert main([*_argv(model, tmp_path, "--out", str(tmp_path / "h")), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("seconds", ["0", "-5", "nan"])
def test_train_seconds_must_be_positive(model: Path, tmp_path: Path, capsys, seconds: str) -> None:
    with pytest.raises(SystemExit) as bad:  # refused by the parser, before the model loads
        main(_argv(model, tmp_path, "--features", "on-the-fly", "--train-seconds", seconds))
    assert bad.value.code == 2 and "--train-seconds: must be > 0" in capsys.readouterr().err

"""``scripts/onthefly_head.py`` (the timed GPU job) end to end on a tiny model folder, on the CPU:
prepare the ids, then self prompts, answers and on-the-fly training within short budgets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from evospec.models.eagle import load_eagle
from evospec.tokenizer import TextCodec
from tests.indices.helpers import CORPUS, tiny_codec, tiny_model_for, write_model_folder

SCRIPT = Path(__file__).parents[2] / "scripts" / "onthefly_head.py"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_prepare_then_run_writes_answers_and_a_head(tmp_path: Path) -> None:
    base = tiny_codec(CORPUS.split("\n\n") * 4)
    codec = TextCodec(base.tok, TEMPLATE, base.special)
    model = write_model_folder(tmp_path / "model", tiny_model_for(codec, 0), codec)
    texts = [t for t in CORPUS.replace(". ", ".\n").splitlines() if t.strip()]
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t}]})
            for t in texts
        )
    )
    mix = tmp_path / "mix.npz"
    run = [sys.executable, str(SCRIPT)]
    prep = [*run, "prepare", "--model", str(model), "--data", str(data), str(chats), "--out", str(mix)]
    subprocess.run(prep, check=True, capture_output=True, text=True)
    ids = np.load(mix)
    # each prompt, and each conversation's last user turn (a prompt too); each answered conversation
    assert len(ids["prompts_off"]) - 1 == 2 * len(texts) and len(ids["conv_answers_off"]) - 1 == len(texts)
    out = tmp_path / "out"
    job = [*run, "run", "--model", str(model), "--mix", str(mix), "--out", str(out), "--init", "none"]
    job += ["--device", "cpu", "--self-seconds", "2", "--gen-seconds", "3", "--train-seconds", "3"]
    job += ["--batch-size", "4", "--max-new-tokens", "12", "--cache-len", "160", "--tokens-per-batch", "256"]
    done = subprocess.run([*job, "--holdout", "0.2"], check=True, capture_output=True, text=True)
    assert "self prompts:" in done.stderr and "saved" in done.stderr
    info = json.loads((out / "head" / "training.json").read_text())
    gen = info["generation"]
    assert gen["answers"] > 0 and gen["answer_tokens"] > 0 and info["teacher_forced_sequences"] > 0
    assert "top1@3" in info["train_log"]["initial_holdout"] and info["train_log"]["epochs"]
    assert load_eagle(out / "head").fc.weight.shape[0] > 0
    # the saved answers train again without generating
    again = [
        *job[: job.index("--self-seconds")],
        "--answers",
        str(out / "answers_00.npz"),
        "--train-seconds",
        "2",
    ]
    again[again.index(str(out))] = str(tmp_path / "out2")
    inter = load_eagle(out / "head").cfg.intermediate_size
    again[again.index("none")] = str(out / "head")  # continue the first head, its MLP grown
    redo = subprocess.run(
        [*again, "--batch-size", "4", "--tokens-per-batch", "256", "--widen-mlp", str(2 * inter)],
        capture_output=True,
        text=True,
    )
    assert redo.returncode == 0, redo.stderr[-2000:]
    assert f"{gen['answers']} answers read" in redo.stderr
    assert load_eagle(tmp_path / "out2" / "head").cfg.intermediate_size == 2 * inter

"""Training conversations with the datasets' own answers, for teacher-forced draft data.

Owns: reading the *training-side* sets of ``shared/data`` that carry answers into
(history, answer) pairs, and the same seeded round-robin mix as ``prompts.py`` (any prefix is
balanced across sources). Sources and what counts as the answer:

- ``oasst`` (``en_100_tree.jsonl``): every assistant message of the conversation trees, with
  the path from the root to it as history (multi-turn);
- ``gsm8k_train``: the worked solution, calculator annotations ``<<...>>`` removed and the
  final ``#### N`` written as a sentence;
- ``self_instruct``: each instance's output for the instruction (+ input);
- ``t0_sample``: the template's completion;
- ``translation``: the English side of tatoeba, flores200 and ntrex128 German-English pairs.

Evaluation sets (Spec-Bench, HumanEval, PubMedQA, MT-bench, GSM8K test) are refused by name,
as in ``prompts.py``. Knows text only; the chat template is applied by the caller.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from evospec.train.prompts import EVAL_ONLY, interleave, read_jsonl

Message = dict[str, str]  # {"role": "user" | "assistant", "content": ...}


@dataclass(frozen=True)
class TrainConversation:
    uid: str  # stable id: "tf:<source>:<index>"
    source: str
    history: tuple[Message, ...]  # ends with a user message
    answer: str  # the dataset's assistant reply to it


def _oasst(path: Path) -> Iterator[tuple[tuple[Message, ...], str]]:
    def walk(msg: dict, history: tuple[Message, ...]) -> Iterator[tuple[tuple[Message, ...], str]]:
        role = "user" if msg.get("role") == "prompter" else "assistant"
        text = msg.get("text") or ""
        if role == "assistant" and history and history[-1]["role"] == "user" and text.strip():
            yield history, text
        here = (*history, {"role": role, "content": text})
        for reply in msg.get("replies") or []:
            yield from walk(reply, here)

    for tree in read_jsonl(path):
        yield from walk(tree["prompt"], ())


_CALC = re.compile(r"<<[^>]*>>")


def _gsm8k_answer(text: str) -> str:
    body, _, final = _CALC.sub("", text).rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if body else text


def _pairs(data: Path) -> dict[str, list[tuple[tuple[Message, ...], str]]]:
    def user(text: str) -> tuple[Message, ...]:
        return ({"role": "user", "content": text},)

    out: dict[str, list[tuple[tuple[Message, ...], str]]] = {}
    out["oasst"] = list(_oasst(data / "oasst/en_100_tree.jsonl"))
    out["gsm8k_train"] = [
        (user(r["question"]), _gsm8k_answer(r["answer"])) for r in read_jsonl(data / "gsm8k/train.jsonl")
    ]
    si = []
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        for r in read_jsonl(data / "self_instruct" / name):
            for inst in r.get("instances") or []:
                extra = inst.get("input", "")
                if inst.get("output", "").strip():
                    si.append((user(r["instruction"] + (f"\n\n{extra}" if extra else "")), inst["output"]))
    out["self_instruct"] = si
    t0 = data / "t0_sample/t0_sample_20_per_template_nonews.jsonl"
    out["t0_sample"] = [
        (user(r["prompt"][:3000]), r["completion"].replace("<|endoftext|>", "").strip())
        for r in read_jsonl(t0)
        if r.get("completion", "").replace("<|endoftext|>", "").strip()
    ]
    translation = []
    for de, en in (
        ("tatoeba_deen/tatoeba-test-v2021-08-07.deu", "tatoeba_deen/tatoeba-test-v2021-08-07.eng"),
        ("flores200_deen/deu_Latn.devtest", "flores200_deen/eng_Latn.devtest"),
        ("ntrex128_deen/newstest2019-ref.deu.txt", "ntrex128_deen/newstest2019-src.eng.txt"),
    ):
        src, tgt = (data / de).read_text().splitlines(), (data / en).read_text().splitlines()
        translation += [
            (user(f"Translate German to English: {s}"), t) for s, t in zip(src, tgt, strict=True) if s and t
        ]
    out["translation"] = translation
    return out


def _file_conversations(path: Path) -> list[tuple[tuple[Message, ...], str]]:
    """A JSONL file's ``{"messages": [...]}`` records whose last message is the assistant's
    answer; files of prompt-only records (``{"prompt": ...}``) carry no answers: none."""
    out = []
    for i, rec in enumerate(read_jsonl(path)):
        msgs = rec.get("messages")
        if msgs is None:
            continue
        ok = isinstance(msgs, list) and len(msgs) >= 2 and all(isinstance(m, dict) for m in msgs)
        if not ok or msgs[-1].get("role") != "assistant" or msgs[-2].get("role") != "user":
            raise ValueError(
                f"{path}: record {i + 1}: 'messages' must end with a user and an assistant message"
            )
        history = tuple({"role": m["role"], "content": str(m.get("content", ""))} for m in msgs[:-1])
        out.append((history, str(msgs[-1].get("content", ""))))
    return out


def training_conversations(
    data: str | Path | Sequence[str | Path], *, seed: int = 0
) -> list[TrainConversation]:
    """Every answered training conversation in ``data``, shuffled per source and interleaved
    round-robin: the shared data folder's training-side sets, and JSONL files of
    ``{"messages": [...]}`` records (one source per file, named by its stem)."""
    paths = [Path(data)] if isinstance(data, str | Path) else [Path(d) for d in data]
    per_source: dict[str, list[tuple[tuple[Message, ...], str]]] = {}
    for path in paths:
        if any(part in str(path) for part in EVAL_ONLY):
            raise ValueError(f"{path}: evaluation sets must not be used for training")
        if path.is_dir():
            for source, pairs in _pairs(path).items():
                per_source.setdefault(source, []).extend(pairs)
        elif path.is_file():
            per_source.setdefault(path.stem, []).extend(_file_conversations(path))
        else:
            raise FileNotFoundError(f"{path}: no such training data folder or prompt file")
    return interleave(
        {
            source: [TrainConversation(f"tf:{source}:{i}", source, h, a) for i, (h, a) in enumerate(pairs)]
            for source, pairs in per_source.items()
        },
        seed,
    )

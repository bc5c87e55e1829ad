"""Training prompts for draft heads, from the *training-side* sets of ``shared/data`` only.

Owns: reading oasst, arena_hard, self_instruct, t0_sample, gsm8k train, legalbench,
github_site_policy and German-English translation pairs into user messages, and a seeded,
interleaved mix (any prefix of it is balanced across sources, so a partial run is still
representative). Evaluation sets (Spec-Bench, HumanEval, PubMedQA, MT-bench, GSM8K test) are
refused by name.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

EVAL_ONLY = ("spec_bench", "humaneval", "pubmedqa", "mt_bench", "gsm8k/test")


@dataclass(frozen=True)
class TrainPrompt:
    uid: str  # stable id: "<source>:<index>"
    source: str
    text: str  # the user message


def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                yield rec if isinstance(rec, dict) else {"prompt": rec}


def _clip(text: str, chars: int = 1500) -> str:
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0] + " ..."


def _source_prompts(data: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    out["oasst"] = [r["prompt"] for r in read_jsonl(data / "oasst/oasst_1k_prompts.jsonl")]
    out["oasst"] += [r["prompt"] for r in read_jsonl(data / "oasst/prompt_lottery_en_250_text.jsonl")]
    out["arena_hard"] = [r["prompt"] for r in read_jsonl(data / "arena_hard/question_v0.1.jsonl")]
    out["arena_hard"] += [
        r["prompt"]
        for r in read_jsonl(data / "arena_hard/question_v2.0.jsonl")
        if isinstance(r.get("prompt"), str)
    ]
    si = []
    for name in ("seed_tasks.jsonl", "user_oriented_instructions.jsonl"):
        for r in read_jsonl(data / "self_instruct" / name):
            inst = r.get("instances") or [{}]
            extra = inst[0].get("input", "")
            si.append(r["instruction"] + (f"\n\n{extra}" if extra else ""))
    out["self_instruct"] = si
    out["t0_sample"] = [
        _clip(r["prompt"]) for r in read_jsonl(data / "t0_sample/t0_sample_20_per_template_nonews.jsonl")
    ]
    out["gsm8k_train"] = [r["question"] for r in read_jsonl(data / "gsm8k/train.jsonl")]
    out["legalbench"] = [
        f"Explain in plain words what this contract clause means:\n\n{_clip(r['text'], 1200)}"
        for r in read_jsonl(data / "legalbench/legalbench_permissive.jsonl")
        if len(r.get("text", "")) > 80
    ]
    out["github_site_policy"] = [
        f"Summarize the key points of this policy excerpt:\n\n{_clip(r['text'], 1500)}"
        for r in read_jsonl(data / "github_site_policy/site_policy_docs.jsonl")
    ]
    de = (data / "tatoeba_deen/tatoeba-test-v2021-08-07.deu").read_text().splitlines()
    out["translation"] = [f"Translate German to English: {s}" for s in de if len(s) > 20]
    de2 = (data / "flores200_deen/deu_Latn.devtest").read_text().splitlines()
    out["translation"] += [f"Translate German to English: {s}" for s in de2]
    return out


def _file_prompts(path: Path) -> list[str]:
    """A JSONL file of ``{"prompt": "..."}`` records (other keys ignored), or of
    ``{"messages": [...]}`` conversations (their last user message)."""
    out = []
    for i, rec in enumerate(read_jsonl(path)):
        msgs = rec.get("messages")
        if isinstance(msgs, list):  # a conversation (teacher-forced data): its last user turn
            users = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"]
            if users and isinstance(users[-1], str):
                out.append(users[-1])
                continue
        if not isinstance(rec.get("prompt"), str):
            raise ValueError(f"{path}: record {i + 1} has no string 'prompt'")
        out.append(rec["prompt"])
    return out


def training_prompts(data: str | Path | Sequence[str | Path], *, seed: int = 0) -> list[TrainPrompt]:
    """All training prompts, shuffled per source and interleaved round-robin.

    ``data``: the shared data folder (its training-side sets, one source each) and/or JSONL
    files of ``{"prompt": ...}`` records (one source per file, named by its stem).
    """
    paths = [Path(data)] if isinstance(data, str | Path) else [Path(d) for d in data]
    per_source: dict[str, list[str]] = {}
    for path in paths:
        if any(part in str(path) for part in EVAL_ONLY):
            raise ValueError(f"{path}: evaluation sets must not be used for training")
        if path.is_dir():
            per_source.update(_source_prompts(path))
        elif path.is_file():
            per_source.setdefault(path.stem, []).extend(_file_prompts(path))
        else:
            raise FileNotFoundError(f"{path}: no such training data folder or prompt file")
    return interleave(
        {
            source: [TrainPrompt(f"{source}:{i}", source, t) for i, t in enumerate(texts) if t.strip()]
            for source, texts in per_source.items()
        },
        seed,
    )


def interleave(per_source: dict[str, list], seed: int) -> list:
    """Each source's items shuffled (seeded), then taken round-robin in source-name order, so
    any prefix of the result is balanced across sources."""
    rng = random.Random(seed)
    queues = []
    for _, items in sorted(per_source.items()):
        items = list(items)
        rng.shuffle(items)
        queues.append(items)
    mixed: list = []
    while any(queues):
        for q in queues:
            if q:
                mixed.append(q.pop())
    return mixed


def select_sources(prompts: list[TrainPrompt], sources: Sequence[str] | None) -> list[TrainPrompt]:
    """The prompts of ``sources`` only, in their mixed order (None: all). A name that no prompt
    carries is an error, so a typo cannot silently select nothing."""
    if not sources:
        return prompts
    known = {p.source for p in prompts}
    unknown = sorted(set(sources) - known)
    if unknown:
        raise ValueError(f"unknown prompt source(s) {unknown}; the data has {sorted(known)}")
    keep = set(sources)
    return [p for p in prompts if p.source in keep]

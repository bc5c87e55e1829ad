"""Benchmark prompt sets: Spec-Bench ``question.jsonl``, HumanEval, PubMedQA, plain JSONL.

Owns: reading one or several files, the one wording of a HumanEval / PubMedQA / contract-law
request (shared with the topic-shift stream), per-category sub-sampling and limits. Returns
text (or the first chat turn); ``BenchPrompt.token_ids`` renders it as ``evospec bench`` does.

Record kinds, recognised per line: Spec-Bench (``turns``, ``category``); HumanEval
(``task_id`` + ``prompt``, category ``humaneval``); PubMedQA (``question`` + ``contexts``,
category ``pubmedqa``); plain (``prompt``, optional ``category`` and ``chat``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str  # the user message (Spec-Bench: first turn)
    chat: bool  # render with the chat template

    def token_ids(self, codec) -> list[int]:
        """The request's prompt ids: the chat template around the text, or the text as it is."""
        if self.chat:
            return codec.encode_chat([{"role": "user", "content": self.text}])
        return codec.encode(self.text)


CLIP_CHARS = 1400  # characters of a contract clause / medical abstract put in one request


def humaneval_prompt(rec: dict) -> BenchPrompt:
    return BenchPrompt("humaneval", f"Complete this Python function.\n\n```python\n{rec['prompt']}```", True)


def pubmedqa_prompt(rec: dict) -> BenchPrompt:
    abstract = " ".join(rec.get("contexts", []))[:CLIP_CHARS]
    return BenchPrompt("pubmedqa", f"{abstract}\n\nQuestion: {rec['question']}\nAnswer briefly.", True)


def contract_prompt(text: str) -> BenchPrompt:
    body = text[:CLIP_CHARS]
    return BenchPrompt(
        "law", f"What obligations does this contract clause create for each party?\n\n{body}", True
    )


def _record_prompt(rec: dict) -> BenchPrompt | None:
    if "turns" in rec:
        return BenchPrompt(rec.get("category", "default"), rec["turns"][0], True)
    if "task_id" in rec and "prompt" in rec:
        return humaneval_prompt(rec)
    if "question" in rec and "contexts" in rec:
        return pubmedqa_prompt(rec)
    if "prompt" in rec:
        return BenchPrompt(rec.get("category", "default"), rec["prompt"], bool(rec.get("chat", True)))
    return None


def load_prompts(
    paths: str | Path | Sequence[str | Path], *, per_category: int | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    """Prompts of every file in order; ``per_category`` / ``limit`` apply to the whole list."""
    prompts: list[BenchPrompt] = []
    for path in [paths] if isinstance(paths, str | Path) else paths:
        prompts += _read(Path(path))
    if per_category is not None:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            if seen[p.category] < per_category:
                seen[p.category] += 1
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts


def _read(path: Path) -> list[BenchPrompt]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt file not found")
    prompts: list[BenchPrompt] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
            prompt = _record_prompt(rec) if isinstance(rec, dict) else None
            if prompt is None:
                raise ValueError(
                    f"{path}:{lineno}: expected a Spec-Bench ('turns'), HumanEval ('task_id' + 'prompt'), "
                    "PubMedQA ('question' + 'contexts') or plain ('prompt') record"
                )
            prompts.append(prompt)
    return prompts

"""Benchmark prompt sets: Spec-Bench ``question.jsonl`` and plain ``{"prompt": ...}`` JSONL.

Owns: reading, per-category sub-sampling and limits. Returns text (or the first chat turn);
rendering with a chat template happens at the caller's edge.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchPrompt:
    category: str
    text: str  # the user message (Spec-Bench: first turn)
    chat: bool  # render with the chat template


def load_prompts(
    path: str | Path, *, per_category: int | None = None, limit: int | None = None
) -> list[BenchPrompt]:
    path = Path(path)
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
            if "turns" in rec:
                prompts.append(BenchPrompt(rec.get("category", "default"), rec["turns"][0], True))
            elif "prompt" in rec:
                prompts.append(
                    BenchPrompt(rec.get("category", "default"), rec["prompt"], bool(rec.get("chat", True)))
                )
            else:
                raise ValueError(f"{path}:{lineno}: expected a 'turns' (Spec-Bench) or 'prompt' field")
    if per_category is not None:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            if seen[p.category] < per_category:
                seen[p.category] += 1
                kept.append(p)
        prompts = kept
    return prompts[:limit] if limit is not None else prompts

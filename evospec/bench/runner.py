"""Run decoding methods side by side on the same prompts and summarise them.

Owns: interleaved timing (prompt by prompt, every method in turn, after a warm-up), the
per-method and per-category aggregates (MAL, tok/s, speedup vs AR, agreement with AR), and
the JSON contract ``{"methods": ..., "per_category": ..., "config": ...}``.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from evospec.bench.prompts import BenchPrompt
from evospec.decoding.methods import Decoder
from evospec.decoding.sampling import SamplingParams


@dataclass
class RunRecord:
    """One method on one prompt."""

    method: str
    category: str
    prompt_index: int
    tokens: list[int]
    seconds: float
    rounds: int
    accepted: int
    draft_s: float
    verify_s: float
    extra: dict[str, float] = field(default_factory=dict)


def run_one(
    decoder: Decoder, prompt_ids: Sequence[int], params: SamplingParams
) -> tuple[list[int], float, int, int, float, float]:
    """(tokens, seconds, rounds, accepted, draft_s, verify_s); the prefill token is no round."""
    tokens: list[int] = []
    rounds = accepted = 0
    draft_s = verify_s = 0.0
    t0 = time.perf_counter()
    for ev in decoder.generate(prompt_ids, params):
        tokens.extend(ev.tokens)
        rounds += not ev.prefill
        accepted += ev.accepted
        draft_s += ev.draft_s
        verify_s += ev.verify_s
    return tokens, time.perf_counter() - t0, rounds, accepted, draft_s, verify_s


def run_side_by_side(
    decoders: dict[str, Decoder],
    prompts: Sequence[BenchPrompt],
    encode: Callable[[BenchPrompt], list[int]],
    params: SamplingParams,
    *,
    progress: bool = True,
) -> list[RunRecord]:
    from tqdm.auto import tqdm

    if prompts:  # warm-up: first calls pay for allocation and kernel selection
        warm = SamplingParams(max_new_tokens=min(8, params.max_new_tokens), temperature=params.temperature)
        for dec in decoders.values():
            run_one(dec, encode(prompts[0]), warm)
    records = []
    bar = tqdm(total=len(prompts) * len(decoders), desc="bench", unit="run", disable=not progress)
    for i, p in enumerate(prompts):
        ids = encode(p)
        for name, dec in decoders.items():
            toks, secs, rounds, acc, d_s, v_s = run_one(dec, ids, params)
            records.append(RunRecord(name, p.category, i, toks, secs, rounds, acc, d_s, v_s))
            bar.update(1)
    bar.close()
    return records


def _summarise(recs: list[RunRecord], ar_by_prompt: dict[int, RunRecord] | None) -> dict[str, float]:
    tokens = sum(len(r.tokens) for r in recs)
    seconds = sum(r.seconds for r in recs)
    rounds = sum(r.rounds for r in recs)
    round_tokens = tokens - sum(1 for r in recs if r.tokens)  # minus each prompt's prefill token
    out: dict[str, float] = {
        "mal": round_tokens / max(rounds, 1),
        "tok_per_s": tokens / seconds if seconds else 0.0,
        "tokens": tokens,
        "seconds": seconds,
        "rounds": rounds,
        "draft_s": sum(r.draft_s for r in recs),
        "verify_s": sum(r.verify_s for r in recs),
    }
    if ar_by_prompt:
        per_prompt = [
            (ar_by_prompt[r.prompt_index].seconds / max(len(ar_by_prompt[r.prompt_index].tokens), 1))
            / (r.seconds / max(len(r.tokens), 1))
            for r in recs
            if r.prompt_index in ar_by_prompt and r.tokens
        ]
        out["median_prompt_speedup_vs_ar"] = statistics.median(per_prompt) if per_prompt else 0.0
        same = [
            r.tokens == ar_by_prompt[r.prompt_index].tokens for r in recs if r.prompt_index in ar_by_prompt
        ]
        out["matches_ar"] = sum(same) / len(same) if same else 0.0
    return out


def summarise(records: list[RunRecord], config: dict) -> dict:
    """The benchmark JSON: methods, per_category, config."""
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    ar = {r.prompt_index: r for r in by_method.get("ar", [])}
    methods = {m: _summarise(rs, ar) for m, rs in by_method.items()}
    _add_speedup(methods)
    per_category: dict[str, dict[str, dict[str, float]]] = {}
    for cat in sorted({r.category for r in records}):
        cat_methods = {m: _summarise([r for r in rs if r.category == cat], ar) for m, rs in by_method.items()}
        _add_speedup(cat_methods)
        per_category[cat] = cat_methods
    return {"methods": methods, "per_category": per_category, "config": config}


def _add_speedup(methods: dict[str, dict[str, float]]) -> None:
    base = methods.get("ar", {}).get("tok_per_s")
    for stats in methods.values():
        stats["speedup_vs_ar"] = stats["tok_per_s"] / base if base else float("nan")


def format_table(result: dict) -> str:
    cols = ("mal", "tok_per_s", "speedup_vs_ar", "median_prompt_speedup_vs_ar", "matches_ar")
    head = f"| method | {' | '.join(cols)} |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for name, s in result["methods"].items():
        vals = " | ".join(f"{s[c]:.3f}" if c in s else "-" for c in cols)
        lines.append(f"| {name} | {vals} |")
    return "\n".join(lines)

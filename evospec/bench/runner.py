"""Run decoding methods side by side on the same prompts and summarise them.

Owns: interleaved timing (prompt by prompt, every method in turn, after a warm-up), the
per-method and per-category aggregates (MAL, tok/s, speedup vs AR, agreement with AR, and for
speculative methods the active-vocabulary figures: coverage, active size, OOV events, the
draft time split and retrieval latency), the oracle speed, and the JSON contract
``{"methods": ..., "per_category": ..., "config": ...}``.

Draft time split per round: ``lm_head`` (the draft LM head: projection, log-softmax, top-k),
``gather`` (loading newly active rows), ``backbone`` (the rest of drafting: the draft
transformer layer and tree bookkeeping). Oracle speed (NanoSpec, Eq. 1) of a method: the
full-vocabulary MAL (``eagle2`` in the same run) over that method's own mean verify + draft
time per round; ``oracle_share`` = the method's end-to-end tok/s over its oracle speed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evospec.bench.prompts import BenchPrompt
from evospec.decoding.methods import Decoder
from evospec.decoding.sampling import SamplingParams
from evospec.vocab.active import VocabTotals


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
    vocab: VocabTotals | None = None
    prefill_s: float = 0.0  # the prefill step (prompt forward + first token), inside ``seconds``


def run_one(
    decoder: Decoder, prompt_ids: Sequence[int], params: SamplingParams, method: str = "", category: str = ""
) -> RunRecord:
    """Generate once and time it; the prefill token is no round."""
    rec = RunRecord(method, category, -1, [], 0.0, 0, 0, 0.0, 0.0)
    t0 = time.perf_counter()
    for ev in decoder.generate(prompt_ids, params):
        rec.tokens.extend(ev.tokens)
        rec.rounds += not ev.prefill
        if ev.prefill:
            rec.prefill_s += ev.verify_s + ev.draft_s
        rec.accepted += ev.accepted
        rec.draft_s += ev.draft_s
        rec.verify_s += ev.verify_s
        if ev.vocab is not None:
            rec.vocab = rec.vocab or VocabTotals(latencies=[])
            rec.vocab.add(ev.vocab)
    rec.seconds = time.perf_counter() - t0
    return rec


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
            rec = run_one(dec, ids, params, name, p.category)
            rec.prompt_index = i
            records.append(rec)
            bar.update(1)
    bar.close()
    return records


def _summarise(recs: list[RunRecord], ar_by_prompt: dict[int, RunRecord] | None) -> dict[str, float]:
    tokens = sum(len(r.tokens) for r in recs)
    seconds = sum(r.seconds for r in recs)
    rounds = sum(r.rounds for r in recs)
    round_tokens = tokens - sum(1 for r in recs if r.tokens)  # minus each prompt's prefill token
    decode_s = seconds - sum(r.prefill_s for r in recs)
    out: dict[str, float] = {
        "mal": round_tokens / max(rounds, 1),
        "tok_per_s": tokens / seconds if seconds else 0.0,
        "decode_tok_per_s": round_tokens / decode_s if decode_s > 0 else 0.0,  # after the first token
        "prefill_s_median": statistics.median(r.prefill_s for r in recs) if recs else 0.0,
        "prompts": len(recs),
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
    vocab = [r.vocab for r in recs if r.vocab is not None]
    if vocab:
        out.update(_vocab_summary(vocab, out))
    return out


def _vocab_summary(vocab: list[VocabTotals], base: dict[str, float]) -> dict[str, float]:
    rounds = max(sum(v.rounds for v in vocab), 1)
    lm_head = sum(v.lm_head_s for v in vocab)
    gather = sum(v.gather_s for v in vocab)
    latencies = [x for v in vocab for x in v.latencies or ()]
    merged = len(latencies)
    return {
        "coverage": sum(v.covered for v in vocab) / max(sum(v.verified for v in vocab), 1),
        "active_size": sum(v.active_size_sum for v in vocab) / rounds,
        "oov_events": sum(v.oov_events for v in vocab),
        "draft_ms_per_round": 1e3 * base["draft_s"] / rounds,
        "verify_ms_per_round": 1e3 * base["verify_s"] / rounds,
        "backbone_ms_per_round": 1e3 * (base["draft_s"] - lm_head - gather) / rounds,
        "lm_head_ms_per_round": 1e3 * lm_head / rounds,
        "gather_ms_per_round": 1e3 * gather / rounds,
        "policy_ms_per_round": 1e3 * sum(v.policy_s for v in vocab) / rounds,
        "rows_gathered_per_round": sum(v.rows_gathered for v in vocab) / rounds,
        "retrievals": merged,
        "retrieval_ms_median": 1e3 * statistics.median(latencies) if latencies else float("nan"),
        "retrieval_late_share": sum(v.late for v in vocab) / merged if merged else float("nan"),
        "retrieval_errors": sum(v.errors for v in vocab),
        "retrieval_dropped": sum(v.dropped for v in vocab),
    }


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
    base_decode = methods.get("ar", {}).get("decode_tok_per_s")
    full_mal = methods.get("eagle2", {}).get("mal")
    for stats in methods.values():
        stats["speedup_vs_ar"] = stats["tok_per_s"] / base if base else float("nan")
        stats["decode_speedup_vs_ar"] = (
            stats["decode_tok_per_s"] / base_decode if base_decode else float("nan")
        )
        if full_mal and "draft_ms_per_round" in stats:
            round_s = (stats["draft_ms_per_round"] + stats["verify_ms_per_round"]) / 1e3
            stats["oracle_tok_per_s"] = full_mal / round_s if round_s else float("nan")
            stats["oracle_share"] = stats["tok_per_s"] / stats["oracle_tok_per_s"]


SPEED_COLS = (
    "mal",
    "tok_per_s",
    "speedup_vs_ar",
    "median_prompt_speedup_vs_ar",
    "decode_tok_per_s",
    "decode_speedup_vs_ar",
    "prefill_s_median",
    "matches_ar",
)
VOCAB_COLS = (
    "coverage",
    "active_size",
    "oov_events",
    "backbone_ms_per_round",
    "lm_head_ms_per_round",
    "gather_ms_per_round",
    "verify_ms_per_round",
    "retrieval_ms_median",
    "retrieval_late_share",
    "oracle_tok_per_s",
    "oracle_share",
)


def _table(methods: dict[str, dict[str, float]], cols: Sequence[str]) -> list[str]:
    lines = [f"| method | {' | '.join(cols)} |", "|" + "---|" * (len(cols) + 1)]
    for name, s in methods.items():
        vals = " | ".join(_fmt(s[c]) if c in s else "-" for c in cols)
        lines.append(f"| {name} | {vals} |")
    return lines


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"


def _category_table(per_category: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """One row per category: AR's tok/s, then each other method's MAL and speedup vs AR."""
    names = list(next(iter(per_category.values())))
    others = [m for m in names if m != "ar"]
    head = ["category", "prompts", *(["ar tok/s"] if "ar" in names else [])]
    head += [f"{m} {c}" for m in others for c in ("MAL", "vs AR")]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for cat, methods in per_category.items():
        first = methods[names[0]]
        cells = [cat, str(int(first["prompts"])) if "prompts" in first else "-"]
        if "ar" in methods:
            cells.append(f"{methods['ar']['tok_per_s']:.2f}")
        for m in others:
            s = methods.get(m, {})
            cells += [f"{s['mal']:.2f}" if "mal" in s else "-", f"{s.get('speedup_vs_ar', math.nan):.2f}"]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def format_table(result: dict) -> str:
    """Markdown: the speed table, then (if any method drafted) the vocabulary table, then (with
    more than one category) MAL and speedup per category."""
    lines = _table(result["methods"], SPEED_COLS)
    spec = {m: s for m, s in result["methods"].items() if "coverage" in s}
    if spec:
        lines += ["", *_table(spec, VOCAB_COLS)]
    if len(result.get("per_category", {})) > 1:
        lines += ["", *_category_table(result["per_category"])]
    return "\n".join(lines)

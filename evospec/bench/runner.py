"""Run decoding methods side by side on the same prompts and summarise them.

Owns: interleaved timing (prompt by prompt, every method in turn, after a warm-up; an adaptive
method's queued updates finish before the next method is timed), the
per-method and per-category aggregates (MAL, acceptance by depth, tok/s, speedup vs AR,
agreement with AR, and for speculative methods the active-vocabulary figures: coverage, active
size, OOV events, the draft time split and retrieval latency), the oracle speed, the markdown
tables, and the JSON contract ``{"methods": ..., "per_category": ..., "config": ...}``.

Counting is not done here: each run's events fold into a
:class:`~evospec.decoding.stats.RequestStats` (``run_one``), and a method's or category's runs
merge into one, whose ``mal`` and ``acceptance_by_depth`` the summary reports (MAL = accepted
+ 1 per round before clipping, the prefill no round; see docs/engine.md). ``acceptance_by_depth``
lists, for d = 1 .. the deepest tree in ``config["tree"]`` (or the deepest acceptance seen),
the share of rounds that accepted at least d draft tokens.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from evospec.bench.prompts import BenchPrompt
from evospec.decoding.methods import Decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats
from evospec.vocab.active import VocabTotals


def bench_stats() -> RequestStats:
    """An empty fold that keeps every retrieval latency (the summary reports their median)."""
    return RequestStats(vocab=VocabTotals(latencies=[]))


@dataclass
class RunRecord:
    """One method on one prompt: its output and its events folded."""

    method: str
    category: str
    prompt_index: int
    tokens: list[int]  # [T] the output ids (compared with AR's)
    seconds: float  # wall time of the whole generate call, prefill included
    stats: RequestStats = field(default_factory=bench_stats)


def run_one(
    decoder: Decoder, prompt_ids: Sequence[int], params: SamplingParams, method: str = "", category: str = ""
) -> RunRecord:
    """Generate once, time it and fold its events."""
    rec = RunRecord(method, category, -1, [], 0.0)
    t0 = time.perf_counter()
    for ev in decoder.generate(prompt_ids, params):
        rec.tokens.extend(ev.tokens)
        rec.stats.add(ev)
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
            settle(dec)
            prefix = getattr(dec, "prefix", None)
            if prefix is not None:  # the first timed prompt prefills in full, as the others do
                prefix.forget()
    records = []
    bar = tqdm(total=len(prompts) * len(decoders), desc="bench", unit="run", disable=not progress)
    for i, p in enumerate(prompts):
        ids = encode(p)
        for name, dec in decoders.items():
            rec = run_one(dec, ids, params, name, p.category)
            settle(dec)
            rec.prompt_index = i
            records.append(rec)
            bar.update(1)
    bar.close()
    return records


def settle(decoder: Decoder) -> None:
    """Let a decoder's background work (an adapter's queued updates) finish, untimed, so that
    it does not run on the cores while the next method is timed. What overlaps the decoder's
    own run stays in its own timing, as it would in serving."""
    adapt = getattr(decoder, "adapt", None)
    if adapt is not None:
        adapt.wait_idle()


def _summarise(
    recs: list[RunRecord], ar_by_prompt: dict[int, RunRecord] | None, depth: int
) -> dict[str, Any]:
    total = bench_stats()
    for r in recs:
        total.merge(r.stats)
    seconds = sum(r.seconds for r in recs)
    round_tokens = total.tokens - sum(1 for r in recs if r.tokens)  # minus each prompt's prefill token
    decode_s = seconds - total.prefill_s
    mal = total.mal
    out: dict[str, Any] = {
        "mal": math.nan if mal is None else mal,
        "acceptance_by_depth": total.acceptance_by_depth(depth),
        "tok_per_s": total.tokens / seconds if seconds else 0.0,
        "decode_tok_per_s": round_tokens / decode_s if decode_s > 0 else 0.0,  # after the first token
        "prefill_s_median": statistics.median(r.stats.prefill_s for r in recs) if recs else 0.0,
        "prompts": len(recs),
        "tokens": total.tokens,
        "seconds": seconds,
        "rounds": total.rounds,
        # the rounds a draft model proposed for, and those verifying model-free proposals
        # (context lookup, the n-gram table); the rest verified the root alone
        "drafted_share": total.drafted / total.rounds if total.rounds else 0.0,
        "model_free_share": total.model_free / total.rounds if total.rounds else 0.0,
        "draft_s": total.draft_s,
        "verify_s": total.verify_s,
        "round_verify_s": total.verify_s - total.prefill_s,  # the rounds' target forwards only
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
    if total.vocab.rounds:
        out.update(_vocab_summary(total.vocab, out))
    return out


def _vocab_summary(vocab: VocabTotals, base: dict[str, Any]) -> dict[str, float]:
    rounds = vocab.rounds
    latencies = vocab.latencies or []
    merged = len(latencies)
    return {
        "coverage": vocab.covered / max(vocab.verified, 1),
        "active_size": vocab.active_size_sum / rounds,
        "oov_events": vocab.oov_events,
        "draft_ms_per_round": 1e3 * base["draft_s"] / rounds,
        "verify_ms_per_round": 1e3 * base["round_verify_s"] / rounds,  # the prefill is no round
        "backbone_ms_per_round": 1e3 * (base["draft_s"] - vocab.lm_head_s - vocab.gather_s) / rounds,
        "lm_head_ms_per_round": 1e3 * vocab.lm_head_s / rounds,
        # the draft LM head's share of the rounds' time (draft + verify)
        "lm_head_share": vocab.lm_head_s / max(base["draft_s"] + base["round_verify_s"], 1e-12),
        "gather_ms_per_round": 1e3 * vocab.gather_s / rounds,
        "policy_ms_per_round": 1e3 * vocab.policy_s / rounds,
        "rows_gathered_per_round": vocab.rows_gathered / rounds,
        "retrievals": merged,
        "retrieval_ms_median": 1e3 * statistics.median(latencies) if latencies else float("nan"),
        "retrieval_late_share": vocab.late / merged if merged else float("nan"),
        "retrieval_errors": vocab.errors,
        "retrieval_dropped": vocab.dropped,
    }


def report_depth(stats: Iterable[RequestStats], config: dict) -> int:
    """Depths a summary reports acceptance for: the deepest tree in ``config["tree"]`` (method ->
    tree config), or the deepest acceptance seen if that is deeper; 0 when nothing drafted."""
    trees = [t for t in (config.get("tree") or {}).values() if isinstance(t, dict)]
    seen = [len(s.depth_counts) for s in stats]
    return max([*seen, *(int(t.get("depth", 0)) for t in trees)], default=0)


def summarise(records: list[RunRecord], config: dict) -> dict:
    """The benchmark JSON: methods, per_category, config."""
    by_method: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_method[r.method].append(r)
    ar = {r.prompt_index: r for r in by_method.get("ar", [])}
    depth = report_depth((r.stats for r in records), config)
    methods = {m: _summarise(rs, ar, depth) for m, rs in by_method.items()}
    _add_speedup(methods)
    per_category: dict[str, dict[str, dict[str, Any]]] = {}
    for cat in sorted({r.category for r in records}):
        cat_methods = {
            m: _summarise([r for r in rs if r.category == cat], ar, depth) for m, rs in by_method.items()
        }
        _add_speedup(cat_methods)
        per_category[cat] = cat_methods
    return {"methods": methods, "per_category": per_category, "config": config}


def _add_speedup(methods: dict[str, dict[str, Any]]) -> None:
    base = methods.get("ar", {}).get("tok_per_s")
    base_decode = methods.get("ar", {}).get("decode_tok_per_s")
    full_mal = methods.get("eagle2", {}).get("mal")
    fr = methods.get("frspec", {})  # EvoSpec's Table 8 normalises MAL and speed to FR-Spec's
    for stats in methods.values():
        if fr.get("mal") and fr.get("tok_per_s"):
            stats["mal_vs_frspec"] = stats["mal"] / fr["mal"] if "mal" in stats else float("nan")
            stats["speedup_vs_frspec"] = stats["tok_per_s"] / fr["tok_per_s"]
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
    "mal_vs_frspec",
    "speedup_vs_frspec",
    "prefill_s_median",
    "drafted_share",
    "model_free_share",
    "matches_ar",
)
VOCAB_COLS = (
    "coverage",
    "active_size",
    "oov_events",
    "backbone_ms_per_round",
    "lm_head_ms_per_round",
    "lm_head_share",
    "gather_ms_per_round",
    "verify_ms_per_round",
    "retrieval_ms_median",
    "retrieval_late_share",
    "oracle_tok_per_s",
    "oracle_share",
)


def _table(methods: dict[str, dict[str, Any]], cols: Sequence[str]) -> list[str]:
    lines = [f"| method | {' | '.join(cols)} |", "|" + "---|" * (len(cols) + 1)]
    for name, s in methods.items():
        vals = " | ".join(_fmt(s[c]) if c in s else "-" for c in cols)
        lines.append(f"| {name} | {vals} |")
    return lines


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3f}"


def _category_table(per_category: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
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


def drafted(stats: dict[str, Any]) -> bool:
    """A method's summary shows drafting: vocabulary figures, or a draft token accepted."""
    return "coverage" in stats or any(stats.get("acceptance_by_depth") or ())


def _depth_table(methods: dict[str, dict[str, Any]]) -> list[str]:
    """One row per method: the share of rounds accepting >= d draft tokens, d = 1.. (none at depth 0)."""
    depth = max((len(s.get("acceptance_by_depth") or ()) for s in methods.values()), default=0)
    if not depth:
        return []
    lines = [
        f"| acceptance by depth | {' | '.join(f'd={d}' for d in range(1, depth + 1))} |",
        "|" + "---|" * (depth + 1),
    ]
    for name, s in methods.items():
        shares = s.get("acceptance_by_depth") or []
        cells = [f"{x:.3f}" for x in shares] + ["-"] * (depth - len(shares))
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def format_table(result: dict) -> str:
    """Markdown: the speed table, then (if any method drafted) the vocabulary table and the
    acceptance-by-depth table, then (with more than one category) MAL and speedup per category."""
    lines = _table(result["methods"], SPEED_COLS)
    spec = {m: s for m, s in result["methods"].items() if "coverage" in s}
    if spec:
        lines += ["", *_table(spec, VOCAB_COLS)]
    depth_table = _depth_table({m: s for m, s in result["methods"].items() if drafted(s)})
    if depth_table:
        lines += ["", *depth_table]
    if len(result.get("per_category", {})) > 1:
        lines += ["", *_category_table(result["per_category"])]
    return "\n".join(lines)

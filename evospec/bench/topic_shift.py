"""The controlled topic-shift scenario (EvoSpec paper section 4.3, scaled to a CPU).

Owns: the request stream (HumanEval prompts, then law (LegalBench) and medicine (PubMedQA)
prompts alternating, from the shared data folder), running methods through it interleaved
request by request (each method keeps its own adapter state across the stream), and the
summary: per-request MAL, mean MAL over the stream's second half, round-time percentiles,
and each adaptive method's auxiliary memory and update counters. Plots per-request MAL.

The stream is ``code`` requests then ``shift`` requests; "second half" means the requests
after the shift. Adapters start from the base head (they are reset after the warm-up).
Every request's events fold into a :class:`~evospec.decoding.stats.RequestStats`; MAL is its
``mal`` (accepted + 1 per round before clipping, the prefill no round; docs/engine.md).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from evospec.bench.prompts import BenchPrompt, contract_prompt, humaneval_prompt, pubmedqa_prompt
from evospec.bench.runner import report_depth
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats

_MIN_LAW_CHARS = 200  # shorter LegalBench items (labels, fragments) are skipped


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (the topic-shift stream reads the shared data folder)")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def topic_shift_stream(data: Path, code: int, shift: int) -> list[BenchPrompt]:
    """``code`` HumanEval prompts, then ``shift`` prompts alternating law / medicine."""
    humaneval = _jsonl(data / "humaneval" / "prompts.jsonl")
    law = [
        r
        for r in _jsonl(data / "legalbench" / "legalbench_permissive.jsonl")
        if len(r.get("text", "")) > _MIN_LAW_CHARS
    ]
    med = _jsonl(data / "pubmedqa" / "pqal.jsonl")
    law = law[::-1]  # from the end of the file: the head's training prompts sample it from the front
    need_law, need_med = (shift + 1) // 2, shift // 2
    if code > len(humaneval) or need_law > len(law) or need_med > len(med):
        raise ValueError(
            f"stream too long: {code} code / {shift} shifted requests, the data has {len(humaneval)} "
            f"HumanEval, {len(law)} law and {len(med)} medicine prompts"
        )
    out = [replace(humaneval_prompt(r), category="code") for r in humaneval[:code]]
    for i in range(shift):
        if i % 2 == 0:
            out.append(contract_prompt(law[i // 2]["text"]))
        else:
            out.append(replace(pubmedqa_prompt(med[i // 2]), category="medicine"))
    return out


@dataclass
class RequestRecord:
    """One method on one request of the stream."""

    method: str
    index: int
    category: str
    stats: RequestStats = field(default_factory=RequestStats)  # the request's events, folded
    seconds: float = 0.0  # wall time of the request (0 in a replay)
    round_times: list[float] = field(default_factory=list)  # [rounds] each round's wall time (live only)

    @property
    def mal(self) -> float:
        """The request's MAL; 1.0 for a request that ended at its prefill (no rounds)."""
        mal = self.stats.mal
        return 1.0 if mal is None else mal


def run_stream(
    decoders: dict,
    stream: Sequence[BenchPrompt],
    encode: Callable[[BenchPrompt], list[int]],
    params: SamplingParams,
    *,
    reference: dict[int, list[int]] | None = None,
    progress: bool = True,
    keyed: bool = False,
) -> tuple[list[RequestRecord], dict[str, int]]:
    """Every request on every method in turn. Returns the records and, per method, how many
    outputs differ from the first method's (all must be 0: the methods are lossless).
    ``keyed``: each adapter keeps one state per request category (a tenant key per domain)."""
    from tqdm.auto import tqdm

    warm = SamplingParams(max_new_tokens=4)
    for dec in decoders.values():
        list(dec.generate(encode(stream[0]), warm))
        if getattr(dec, "adapt", None) is not None:
            dec.adapt.reset(all_keys=True)
    records: list[RequestRecord] = []
    mismatches = dict.fromkeys(decoders, 0)
    bar = tqdm(total=len(stream) * len(decoders), desc="topic-shift", unit="run", disable=not progress)
    for i, p in enumerate(stream):
        ids = encode(p)
        first: list[int] | None = None
        for name, dec in decoders.items():
            _select(dec, p, keyed)
            rec = RequestRecord(name, i, p.category)
            out: list[int] = []
            t0 = time.perf_counter()
            for ev in dec.generate(ids, params):
                out.extend(ev.tokens)
                rec.stats.add(ev)
                if not ev.prefill:
                    rec.round_times.append(ev.round_s)
            rec.seconds = time.perf_counter() - t0
            first = out if first is None else first
            mismatches[name] += out != first
            records.append(rec)
            bar.update(1)
    bar.close()
    for dec in decoders.values():
        if getattr(dec, "adapt", None) is not None:
            dec.adapt.wait_idle()
    return records, mismatches


def _select(dec, prompt: BenchPrompt, keyed: bool) -> None:
    adapt = getattr(dec, "adapt", None)
    if adapt is not None:
        adapt.select(prompt.category if keyed else None)


def replay_stream(
    decoders: dict,
    stream: Sequence[BenchPrompt],
    recorded: Sequence,
    *,
    progress: bool = True,
    keyed: bool = False,
) -> list[RequestRecord]:
    """Like :func:`run_stream`, but every method replays the target's recorded greedy answers
    (``bench/replay.py``): the same acceptance and adapter feedback, no verify forwards, no
    wall times (a record's ``seconds`` and ``round_times`` stay empty)."""
    from tqdm.auto import tqdm

    from evospec.bench.replay import replay_request

    for dec in decoders.values():
        if getattr(dec, "adapt", None) is not None:
            dec.adapt.reset(all_keys=True)
    records: list[RequestRecord] = []
    bar = tqdm(total=len(stream) * len(decoders), desc="topic-shift replay", unit="run", disable=not progress)
    for i, (p, rec) in enumerate(zip(stream, recorded, strict=True)):
        for name, dec in decoders.items():
            _select(dec, p, keyed)
            records.append(RequestRecord(name, i, p.category, replay_request(dec, rec)))
            bar.update(1)
    bar.close()
    for dec in decoders.values():
        if getattr(dec, "adapt", None) is not None:
            dec.adapt.wait_idle()
    return records


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise_stream(records: list[RequestRecord], code: int, decoders: dict, config: dict) -> dict:
    """Per method: MAL over the stream (all its requests' events merged) and by depth, the
    mean per-request MAL before / after the shift and by category, tok/s, round percentiles,
    and the adapter's state."""
    depth = report_depth((r.stats for r in records), config)
    methods: dict[str, dict] = {}
    for name in decoders:
        recs = [r for r in records if r.method == name]
        before = [r.mal for r in recs if r.index < code]
        after = [r.mal for r in recs if r.index >= code]
        rounds = [x for r in recs for x in r.round_times]
        total = RequestStats()
        for r in recs:
            total.merge(r.stats)
        seconds = sum(r.seconds for r in recs)
        timed = bool(rounds)  # a replayed stream has no wall times
        s = {
            "mal": total.mal if total.mal is not None else 1.0,
            "acceptance_by_depth": total.acceptance_by_depth(depth),
            "mal_first_half": statistics.fmean(before) if before else float("nan"),
            "mal_second_half": statistics.fmean(after) if after else float("nan"),
            "tok_per_s": total.tokens / seconds if timed and seconds else None,
            "round_ms_p50": 1e3 * _pct(rounds, 0.5) if timed else None,
            "round_ms_p99": 1e3 * _pct(rounds, 0.99) if timed else None,
            "per_request_mal": [round(r.mal, 4) for r in recs],
            "mal_by_category": {
                c: statistics.fmean(r.mal for r in recs if r.category == c)
                for c in dict.fromkeys(r.category for r in recs)
            },
        }
        adapt = getattr(decoders[name], "adapt", None)
        if adapt is not None:
            st = adapt.state()
            s["adapt"] = st
            s["aux_mib"] = st["aux_bytes"]["total"] / 2**20
        methods[name] = s
    base = config.get("frozen")
    if base in methods:
        b = methods[base]
        for s in methods.values():
            s["second_half_vs_frozen"] = s["mal_second_half"] / b["mal_second_half"]
            if s["round_ms_p99"] is not None and b["round_ms_p99"]:
                s["p99_round_vs_frozen"] = s["round_ms_p99"] / b["round_ms_p99"]
    if "clora" in methods and "osd" in methods and "aux_mib" in methods["osd"]:
        methods["clora"]["aux_vs_osd"] = methods["clora"]["aux_mib"] / methods["osd"]["aux_mib"]
    categories = [r.category for r in records if r.method == next(iter(decoders))]
    return {"methods": methods, "categories": categories, "config": config}


def format_stream_table(result: dict) -> str:
    cols = (
        "mal_first_half",
        "mal_second_half",
        "second_half_vs_frozen",
        "tok_per_s",
        "round_ms_p50",
        "round_ms_p99",
        "p99_round_vs_frozen",
        "aux_mib",
    )
    head = f"| method | {' | '.join(cols)} | updates | discarded | publish lag p50/p90 |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for name, s in result["methods"].items():
        vals = " | ".join(f"{s[c]:.3f}" if isinstance(s.get(c), float) else "-" for c in cols)
        ad = s.get("adapt", {})
        lag = ad.get("publish_lag_rounds")
        lag_s = f"{lag['median']}/{lag['p90']}" if lag else "-"
        lines.append(f"| {name} | {vals} | {ad.get('updates', '-')} | {ad.get('discarded', '-')} | {lag_s} |")
    lines += ["", *_category_table(result)]
    if "aux_vs_osd" in result["methods"].get("clora", {}):
        lines.append(f"\nclora aux memory / osd aux memory: {result['methods']['clora']['aux_vs_osd']:.3f}")
    return "\n".join(lines)


def _category_table(result: dict) -> list[str]:
    """Mean request MAL per category (domain), and its ratio to the frozen method's."""
    methods = result["methods"]
    cats = list(dict.fromkeys(result["categories"]))
    base = methods.get(result["config"].get("frozen"), {}).get("mal_by_category")
    lines = [f"| MAL by category | {' | '.join(cats)} |", "|" + "---|" * (len(cats) + 1)]
    for name, s in methods.items():
        by = s["mal_by_category"]
        cells = [f"{by[c]:.3f}" + (f" ({by[c] / base[c]:.3f}x)" if base else "") for c in cats]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def plot_stream(result: dict, out_dir: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plots needs matplotlib: pip install matplotlib") from exc
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, s in result["methods"].items():
        ax.plot(range(len(s["per_request_mal"])), s["per_request_mal"], marker=".", lw=1, label=name)
    shift = result["config"]["code_requests"]
    ax.axvline(shift - 0.5, ls=":", color="k")
    ax.set_xlabel("request (HumanEval | law / medicine)")
    ax.set_ylabel("MAL (tokens per round)")
    ax.set_title(f"topic shift: {result['config'].get('model', '')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "topic_shift.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

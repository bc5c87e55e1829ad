"""The long-horizon scenario (EvoSpec paper section 4.4, on Topical-Chat instead of LMSYS-Chat).

Owns: reading multi-turn conversations (``topical_chat/test_freq.json`` of the shared data:
human-human chats of ~22 turns; its first speaker's turns are replayed as the user, the model
answers in place of the second), replaying them chronologically with the model's own answers
kept in the context, and the summary: per method, the mean and sample standard deviation
across conversations of MAL, tok/s and speedup over ``ar`` (each first computed within one
conversation, as the paper does).

Before each conversation every decoder forgets what it learnt while serving -- the ARC buffer
(``vocab.reset_dynamic``) and every adapter state with its replay buffer (``adapt.reset``) --
so state evolves within one conversation and never crosses to the next. Methods run turn by
turn in turn (interleaved timing). Each method keeps its own transcript; every answer must
equal the first method's (they are lossless), which the summary counts.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from evospec.bench.runner import settle
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.stats import RequestStats

CONVERSATIONS_FILE = Path("topical_chat") / "test_freq.json"


def load_conversations(data: Path, n: int, max_turns: int) -> list[list[str]]:
    """The user turns (first speaker, at most ``max_turns``) of the first ``n`` conversations,
    in the file's order (the key order of the JSON object)."""
    path = Path(data) / CONVERSATIONS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (the conversation scenario reads the shared data folder)")
    raw = json.loads(path.read_text())
    out: list[list[str]] = []
    for conv in raw.values():
        turns = conv.get("content", [])
        if not turns:
            continue
        first = turns[0]["agent"]
        user = [t["message"].strip() for t in turns if t["agent"] == first and t["message"].strip()]
        if len(user) >= 2:
            out.append(user[:max_turns])
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"{path}: only {len(out)} conversations with two or more user turns, {n} asked")
    return out


@dataclass
class ConversationRecord:
    """One method over one whole conversation."""

    method: str
    index: int
    turns: int = 0
    seconds: float = 0.0  # wall time of its turns (prefill included)
    stats: RequestStats = field(default_factory=RequestStats)
    context_tokens: int = 0  # prompt length of the last turn
    prompt_tokens: int = 0  # prompt tokens over all its turns (each turn re-sends the conversation)


def reset_learnt(dec) -> None:
    """Forget the ARC buffer and every adapter state (a new conversation starts from scratch)."""
    if getattr(dec, "vocab", None) is not None:
        dec.vocab.reset_dynamic()
    if getattr(dec, "adapt", None) is not None:
        dec.adapt.reset(all_keys=True)


def run_conversations(
    decoders: dict,
    conversations: Sequence[list[str]],
    codec,
    params: SamplingParams,
    *,
    progress: bool = True,
) -> tuple[list[ConversationRecord], dict[str, int]]:
    """Replay every conversation on every method; returns the records and, per method, how many
    answers differ from the first method's."""
    from tqdm.auto import tqdm

    for dec in decoders.values():  # warm-up: allocation, kernel selection
        list(
            dec.generate(
                codec.encode_chat([{"role": "user", "content": "Hi"}]), SamplingParams(max_new_tokens=4)
            )
        )
    records: list[ConversationRecord] = []
    mismatches = dict.fromkeys(decoders, 0)
    bar = tqdm(
        total=sum(map(len, conversations)) * len(decoders),
        desc="conversations",
        unit="turn",
        disable=not progress,
    )
    for ci, user_turns in enumerate(conversations):
        for dec in decoders.values():
            reset_learnt(dec)
        recs = {name: ConversationRecord(name, ci) for name in decoders}
        history = {name: [] for name in decoders}
        for text in user_turns:
            first: list[int] | None = None
            for name, dec in decoders.items():
                messages = history[name]
                messages.append({"role": "user", "content": text})
                ids = codec.encode_chat(messages)
                out: list[int] = []
                t0 = time.perf_counter()
                for ev in dec.generate(ids, params):
                    out.extend(ev.tokens)
                    recs[name].stats.add(ev)
                recs[name].seconds += time.perf_counter() - t0
                settle(dec)  # an adapter's queued updates finish before the next method is timed
                recs[name].turns += 1
                recs[name].context_tokens = len(ids)
                recs[name].prompt_tokens += len(ids)
                messages.append({"role": "assistant", "content": codec.decode(out)})
                first = out if first is None else first
                mismatches[name] += out != first
                bar.update(1)
        records.extend(recs.values())
    bar.close()
    return records, mismatches


def _mean_std(xs: list[float]) -> dict:
    return {
        "mean": statistics.fmean(xs) if xs else None,
        "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def summarise_conversations(records: list[ConversationRecord], config: dict) -> dict:
    """Per method: MAL, tok/s and speedup over ``ar`` (when it ran) per conversation, and their
    mean and sample standard deviation across conversations."""
    names = list(dict.fromkeys(r.method for r in records))
    by = {(r.method, r.index): r for r in records}
    indices = sorted({r.index for r in records})
    methods: dict[str, dict] = {}
    for name in names:
        mal = [by[name, i].stats.mal or 1.0 for i in indices]
        tps = [by[name, i].stats.tokens / by[name, i].seconds for i in indices if by[name, i].seconds]
        recs = [by[name, i] for i in indices]
        entry = {
            "mal": _mean_std(mal),
            "tok_per_s": _mean_std(tps),
            "per_conversation_mal": mal,
            # the prompts' prefills, per turn, and the share of prompt tokens reused from the cache
            "prefill_s_per_turn": _mean_std([r.stats.prefill_s / r.turns for r in recs if r.turns]),
            "cached_share": _mean_std(
                [r.stats.cached_tokens / r.prompt_tokens for r in recs if r.prompt_tokens]
            ),
        }
        if "ar" in names and by["ar", indices[0]].seconds:
            ratios = [
                by["ar", i].seconds
                / by[name, i].seconds
                * by[name, i].stats.tokens
                / by["ar", i].stats.tokens
                for i in indices
            ]
            entry["speedup_vs_ar"] = _mean_std(ratios)
        methods[name] = entry
    last = [by[names[0], i].context_tokens for i in indices]
    return {"methods": methods, "config": {**config, "final_context_tokens": _mean_std(last)}}


def format_conversation_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"conversation scenario: {cfg['conversations']} conversations, up to {cfg['max_turns']} user turns, "
        f"answers capped at {cfg['max_new_tokens']} tokens (mean ± std across conversations)",
        "",
        "| method | MAL | tok/s | speedup vs ar | prefill s / turn | prompt tokens reused |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in result["methods"].items():
        sp = m.get("speedup_vs_ar")
        cells = [
            f"{m['mal']['mean']:.3f} ± {m['mal']['std']:.3f}",
            f"{m['tok_per_s']['mean']:.1f} ± {m['tok_per_s']['std']:.1f}" if m["tok_per_s"]["mean"] else "-",
            f"{sp['mean']:.3f} ± {sp['std']:.3f}" if sp else "-",
            _cell(m.get("prefill_s_per_turn"), "{:.3f}"),
            _cell(m.get("cached_share"), "{:.2f}"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(stat: dict | None, fmt: str) -> str:
    return "-" if not stat or stat["mean"] is None else fmt.format(stat["mean"])

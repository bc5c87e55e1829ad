"""What a draft source that learns from the answers already served would add to ``ngram``.

One-off study (docs/benchmarks.md, wave 36). The target (int4, greedy) answers streams of
requests in order -- Spec-Bench (``--per-category`` each), GSM8K test questions, HumanEval
prompts, PubMedQA questions -- and at every position where context lookup (n >= 2) finds
nothing, the sources ``ngram`` could ask are scored: the shipped n-gram table; a live table
counted from the stream's earlier answers (asked first, the shipped table where it has no
guess); the latest earlier occurrence of the context's last n >= 3 tokens in the stream's
earlier answers (cross-request lookup). Printed: rows proposed and tokens accepted per such
position, for proposals of 1 and 2 tokens. Answers are cached in ``--cache``.

    .venv/bin/python scripts/live_table_study.py --data ../shared/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lookup_study import accepted, unmatched

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.lookup import ContextLookup
from evospec.decoding.ngram_table import NgramTable, load_ngram_table
from evospec.decoding.sampling import SamplingParams
from evospec.models.registry import default_ngrams
from evospec.train.ngram_command import PROMPT_TAIL


def stream_prompts(data: Path, per_category: int, n: int) -> dict[str, list[str]]:
    streams = {
        "spec_bench": [
            p.text for p in load_prompts(data / "spec_bench/question.jsonl", per_category=per_category)
        ]
    }
    with open(data / "gsm8k/test.jsonl") as f:
        streams["gsm8k"] = [json.loads(line)["question"] for line in f][:n]
    with open(data / "humaneval/prompts.jsonl") as f:
        streams["humaneval"] = ["Complete this function:\n" + json.loads(line)["prompt"] for line in f][:n]
    with open(data / "pubmedqa/pqal.jsonl") as f:
        streams["pubmedqa"] = [json.loads(line)["question"] for line in f][:n]
    return streams


def answers(args) -> tuple[dict, object]:
    stack = assemble(StackSettings(methods=("ar",), weights="int4"), progress=False)
    cache = Path(args.cache)
    if cache.is_file():
        return json.loads(cache.read_text()), stack
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    out = {}
    for name, texts in stream_prompts(Path(args.data), args.per_category, args.stream).items():
        rows = []
        for text in texts:
            ids = stack.codec.encode_chat([{"role": "user", "content": text}])
            rows.append((ids, [t for ev in stack.decoder("ar").generate(ids, params) for t in ev.tokens]))
        out[name] = rows
        print(name, len(rows), "answers", flush=True)
    cache.write_text(json.dumps(out))
    return out, stack


def study(rows, static: NgramTable, vocab: int, name: str, k: int, min_count: int) -> None:
    seen: list[list[int]] = []
    cross = ContextLookup(3, 5)
    stats = {s: [0, 0] for s in ("static", "live+static", "cross+static", "cross+live+static")}
    misses = 0
    for prompt, out in rows:
        live = (
            NgramTable.count(seen, model="m", vocab_size=vocab, min_count=min_count, min_share=0.3)
            if seen
            else None
        )
        for j, ctx in unmatched(prompt, out):
            misses += 1
            g_static = static.propose(ctx, k)
            g_live = (live.propose(ctx, k) if live is not None else []) or g_static
            g_cross = []
            for n in range(5, 2, -1):  # the latest earlier answer holding the last n tokens
                start = cross._next[n].get(tuple(ctx[-n:]))
                if start is not None:
                    g_cross = cross.tokens[start : start + min(k, n)]
                    break
            for s, g in (
                ("static", g_static),
                ("live+static", g_live),
                ("cross+static", g_cross or g_static),
                ("cross+live+static", g_cross or g_live),
            ):
                stats[s][0] += len(g)
                stats[s][1] += accepted(g, out, j)
        seen.append([*prompt[-PROMPT_TAIL:], *out])
        cross.extend([-1, *prompt[-PROMPT_TAIL:], *out])
    cells = " | ".join(f"{r / misses:.3f} / {a / misses:.3f}" for r, a in stats.values())
    print(f"| {name} | {k} | {min_count} | {misses} | {cells} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--stream", type=int, default=30, help="prompts per GSM8K / HumanEval / PubMedQA stream")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache", default="/tmp/live_table_answers.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    data, stack = answers(args)
    vocab = stack.loaded.model.cfg.vocab_size
    static = load_ngram_table(default_ngrams(stack.loaded.name), vocab)
    print(
        "| stream | k | live min count | positions | static | live+static | cross+static "
        "| cross+live+static |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in data.items():
        for k in (1, 2):
            for min_count in (1, 2):
                study(rows, static, vocab, name, k, min_count)


if __name__ == "__main__":
    main()

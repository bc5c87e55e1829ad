"""Would context evidence fix the head's first drafted token? Teacher-forced, step 1.

At every answer position of the target's greedy answers, this collects the shipped EAGLE-2
head's step-1 log-probs (its top 8, and the log-prob of every candidate below), the tokens that
followed the most recent earlier occurrence of the context's last n tokens (n = 1..5: context
lookup's candidates) and the n-gram table's guess with its share. It then prints, on the
evaluation prompts:

- the head's top-1 agreement and an oracle: the target's token among the head's top-1, the
  lookup candidates and the table's guess;
- a rescoring rule fitted on *training-side* prompts only (``--tune``; the tail of a seeded
  mix, 10 per source): each candidate scores its head log-prob + w[n] (n: the longest context
  match that proposes it) + beta x its table share, and the best score is proposed;
- what a ``--tree auto`` round proposes first (the longest match of n >= 2, else the table's
  guess at share >= 0.3, else the head's top-1);
- the table's guesses at the positions a lookup round would give them, by share and by whether
  the last token's own earlier follower in the context agrees;
- the same split by where a ``--tree auto`` round would draft: positions with a context match
  of n >= 2 (a lookup round proposes there without the head) and the rest.

Used for docs/benchmarks.md, wave 48:

    .venv/bin/python scripts/evidence_study.py --data ../shared/data/spec_bench/question.jsonl \\
        --tune ../shared/data
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from dataclasses import dataclass

import torch
from live_gap import target_answers

from evospec.common import positive_int
from evospec.decoding.ngram_table import NgramTable, load_ngram_table
from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.models.registry import default_head, default_ngrams
from evospec.train.prompts import training_prompts
from evospec.train.trainer import head_unroll

MAX_N = 5  # the longest context match looked up
TOP = 8  # the head's candidates kept per position
GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass
class Position:
    category: str
    target: int
    cands: dict[int, tuple[float, int, float]]  # token -> (head log-prob, longest match n, table share)
    head_top: int
    lookup: int  # what a round proposes first: the longest match's token (n >= 2), else the table's
    # guess at share >= 0.3, else the head's top-1 (a --tree auto round; -1: never)
    match: int  # the longest context match at this position, any token (0: none)
    share: float  # the table's guess's share (0: no guess)
    table: int  # the table's guess (-1: none)
    follower: int  # the token after the latest earlier occurrence of the last token (-1: none)


def known(tokens: list[int], i: int, follow: dict[int, dict]) -> None:
    """Token i is known: the n-grams ending at i - 1 are now followed by it."""
    for n in range(1, MAX_N + 1):
        if i - n >= 0:
            follow[n][tuple(tokens[i - n : i])] = i


def lookup_candidates(tokens: list[int], j: int, follow: dict[int, dict]) -> list[int]:
    """Per n = 1..MAX_N: the token after the latest earlier occurrence of tokens[j - n : j]; -1: none."""
    out = []
    for n in range(1, MAX_N + 1):
        at = follow[n].get(tuple(tokens[j - n : j])) if j - n >= 0 else None
        out.append(tokens[at] if at is not None else -1)
    return out


@torch.inference_mode()
def positions(answers, head, lm_head: torch.Tensor, table: NgramTable) -> list[Position]:
    out = []
    for a in answers:
        feats = a.features.float()
        hidden = head_unroll(head, feats[None, :-1], a.tokens[None, 1 : len(a.features)], 1)[0][0]
        logp = torch.log_softmax(head.logit_input(hidden) @ lm_head.T, -1)  # row i predicts token i + 2
        top = logp.topk(TOP, -1)
        tokens = a.tokens.tolist()
        follow: dict[int, dict] = {n: {} for n in range(1, MAX_N + 1)}  # n-gram -> latest follower's index
        for i in range(1, a.prompt_len + 1):  # the prompt and the root (the first answer token)
            known(tokens, i, follow)
        for j in range(a.prompt_len + 1, len(tokens)):  # token j, drafted at row j - 2
            row = logp[j - 2]
            pairs = zip(top.indices[j - 2].tolist(), top.values[j - 2].tolist(), strict=True)
            cands = {t: (lp, 0, 0.0) for t, lp in pairs}
            ctx = lookup_candidates(tokens, j, follow)
            for n, tok in enumerate(ctx, 1):
                if tok >= 0:
                    lp, _, s = cands.get(tok, (float(row[tok]), 0, 0.0))
                    cands[tok] = (lp, n, s)
            guess = table.guess(tokens[max(0, j - table.info.max_order) : j])
            share = guess[1] if guess else 0.0
            if guess:
                lp, n, _ = cands.get(guess[0], (float(row[guess[0]]), 0, 0.0))
                cands[guess[0]] = (lp, n, share)
            match = max((n for n, tok in enumerate(ctx, 1) if tok >= 0), default=0)
            head_top = int(top.indices[j - 2, 0])
            first = ctx[match - 1] if match >= 2 else guess[0] if guess and share >= 0.3 else head_top
            table_tok = guess[0] if guess else -1
            out.append(
                Position(a.category, tokens[j], cands, head_top, first, match, share, table_tok, ctx[0])
            )
            known(tokens, j, follow)
    return out


def evidence(p: Position, tok: int) -> bool:
    """A context match or the table proposes ``tok`` at ``p``."""
    return tok in p.cands and (p.cands[tok][1] > 0 or p.cands[tok][2] > 0)


def follower_kind(p: Position) -> str:
    """How the last token's earlier follower in the context relates to the table's guess."""
    return "none" if p.follower < 0 else "agrees" if p.follower == p.table else "differs"


def accuracy(ps: list[Position], w: list[float], beta: float) -> float:
    def pick(p: Position) -> int:
        return max(p.cands.items(), key=lambda kv: kv[1][0] + w[kv[1][1]] + beta * kv[1][2])[0]

    return sum(pick(p) == p.target for p in ps) / max(len(ps), 1)


def fit(ps: list[Position]) -> tuple[list[float], float]:
    """Coordinate search over GRID for w[1..MAX_N] and beta (w[0] = 0: no match, no bonus)."""
    w, beta = [0.0] * (MAX_N + 1), 0.0
    for _ in range(3):
        for i in range(1, MAX_N + 1):
            w[i] = max(GRID, key=lambda g, i=i: accuracy(ps, [*w[:i], g, *w[i + 1 :]], beta))
        beta = max(GRID, key=lambda g: accuracy(ps, w, g))
    return w, beta


def tune_prompts(data: str, per_source: int = 10) -> str:
    """A prompts file of the training-side sets: the last ``per_source`` of each source in a mix
    seeded apart from the heads' own (12345)."""
    chosen: dict[str, list] = defaultdict(list)
    for p in reversed(training_prompts(data, seed=12345)):
        if len(chosen[p.source]) < per_source:
            chosen[p.source].append(p)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for source, ps in chosen.items():
            for p in ps:
                f.write(json.dumps({"prompt": p.text, "category": source}) + "\n")
    return f.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="evaluation prompts (Spec-Bench question.jsonl)")
    ap.add_argument("--tune", required=True, help="the shared data folder (the rule is fit on its prompts)")
    ap.add_argument("--per-category", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model("smollm2-135m-instruct", weights="int4", progress=False)
    head = load_eagle(str(default_head("smollm2-135m-instruct"))).attach(loaded.model)
    table = load_ngram_table(default_ngrams("smollm2-135m-instruct"))
    lm_head = loaded.model.lm_head.weight.detach().float()

    def collect(data: str, per_category: int, max_new: int) -> list[Position]:
        ns = argparse.Namespace(
            data=data, per_category=per_category, max_new_tokens=max_new, categories=None, max_len=0
        )
        return positions(target_answers(ns, loaded), head, lm_head, table)

    tune = collect(tune_prompts(args.tune), 10, 96)
    evals = collect(args.data, args.per_category, args.max_new_tokens)
    w, beta = fit(tune)
    print(f"rule fitted on {len(tune)} training-side positions: w[1..{MAX_N}] = {w[1:]}, beta = {beta}")
    print(
        "| positions | count | head top-1 | lookup first, table, head | rule "
        "| oracle (head top-1, lookup, table) |\n|---|---|---|---|---|---|"
    )
    none = [0.0] * (MAX_N + 1)

    def row(name: str, ps: list[Position]) -> None:
        oracle = sum(p.target == p.head_top or evidence(p, p.target) for p in ps)
        first = sum(p.lookup == p.target for p in ps) / max(len(ps), 1)
        cells = [accuracy(ps, none, 0.0), first, accuracy(ps, w, beta), oracle / max(len(ps), 1)]
        print(f"| {name} | {len(ps)} | " + " | ".join(f"{x:.3f}" for x in cells) + " |")

    row("training-side (fitted on)", tune)
    row("evaluation, all", evals)
    row("evaluation, a context match n >= 2 (lookup rounds)", [p for p in evals if p.match >= 2])
    drafted = [p for p in evals if p.match < 2 and p.share < 0.3]
    row("evaluation, no match n >= 2, share < 0.3 (drafted rounds)", drafted)
    by = defaultdict(list)
    for p in evals:
        by[p.category].append(p)
    for cat in sorted(by):
        row(f"evaluation, {cat}", by[cat])
    print(
        "\nThe table's guesses where no context match of n >= 2 proposes (evaluation): right, by share "
        "and by the last token's own earlier follower in the context\n"
        "| share | the follower agrees | differs | none |\n|---|---|---|---|"
    )
    for lo, hi in ((0.12, 0.3), (0.3, 0.5), (0.5, 1.01)):
        cells = []
        for kind in ("agrees", "differs", "none"):
            ps = [
                p
                for p in evals
                if p.match < 2 and p.table >= 0 and lo <= p.share < hi and follower_kind(p) == kind
            ]
            cells.append(f"{sum(p.table == p.target for p in ps) / max(len(ps), 1):.3f} ({len(ps)})")
        print(f"| {lo}-{min(hi, 1.0)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Teacher-forced agreement of EAGLE-2 heads on the target's own answers to benchmark prompts,
and the chain rounds it implies.

Held-out agreement (``scripts/heldout_heads.py``) is measured on training-side answers; live
first-token acceptance on Spec-Bench runs well below it. This script splits that gap: it
generates the target's greedy answers to the benchmark's prompts (the same selection and
chat rendering as ``evospec bench --per-category N``), keeps their features as ``train-draft``
does, and prints per head and per category

- the agreement at every answer position, draft steps 1..3 (step s: a chain rooted s - 1
  tokens back in the answer, on the head's own features from step 2; "positions" are step 1's);
- what 1-token and 3-token chains would accept round by round if every round drafted exactly
  what teacher forcing predicts: a round starts after the previous one's accepted tokens and
  bonus token, so rounds sample the positions unevenly (a rejection is often followed by
  another hard position). These are the live bench's "acceptance by depth" and MAL with no
  timing in them: wave 21 found them equal to the live runs' within 0.005 MAL (head version 8).

With ``--temperature T`` the answers are the target's samples at T (seeded), and a second table
gives, per head, the chance that the verify accepts a first drafted token at T, averaged over
the answer positions: proposing the draft's most likely token (p(argmax q)) against drawing it
from the draft's distribution (sum min(p, q), speculative sampling; wave 33), p and q the
target's and the head's step-1 softmaxes at T through the LM head's float weights.

    .venv/bin/python scripts/live_gap.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 4 --max-new-tokens 64 HEAD [HEAD ...]    # [--temperature 1.0]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from evospec.bench.prompts import load_prompts
from evospec.common import positive_int
from evospec.models.eagle import load_eagle
from evospec.models.loading import load_model
from evospec.train.batch_generate import greedy_stream
from evospec.train.trainer import head_unroll

STEPS = 3


@dataclass
class Answer:
    category: str
    tokens: torch.Tensor  # [T] int64: prompt then answer
    features: torch.Tensor  # [T - 1, D] fp16: every fed position
    prompt_len: int


@dataclass
class Tally:
    hits: list[int] = field(default_factory=lambda: [0] * STEPS)  # per position, step s
    scored: list[int] = field(default_factory=lambda: [0] * STEPS)  # positions step s can reach
    rounds: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # chain depth -> rounds
    accepted: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))  # (depth, d)

    def row(self) -> str:
        agree = " / ".join(f"{h / max(n, 1):.3f}" for h, n in zip(self.hits, self.scored, strict=True))
        cells = [agree]
        for depth in (1, STEPS):
            n = max(self.rounds[depth], 1)
            by_d = [self.accepted[depth, d] / n for d in range(1, depth + 1)]
            cells.append(f"{1 + sum(by_d):.3f} ({' / '.join(f'{a:.3f}' for a in by_d)})")
        return " | ".join(cells)


def target_answers(args: argparse.Namespace, loaded) -> list[Answer]:
    codec = loaded.codec
    prompts = load_prompts(args.data, per_category=args.per_category)
    prompts = [p for p in prompts if not args.categories or p.category in args.categories]
    ids = [p.token_ids(codec) for p in prompts]
    temperature = getattr(args, "temperature", 0.0)
    gen = torch.Generator().manual_seed(0)

    def sample(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]: the target's samples at T
        return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)[:, 0]

    stream = greedy_stream(
        loaded.model,
        ids,
        args.max_new_tokens,
        codec.eos_ids,
        batch_size=8,
        cache_len=max(len(i) for i in ids) + args.max_new_tokens + 8,
        features=True,
        **({"pick": sample} if temperature > 0 else {}),
    )
    out = []
    for d in stream:  # in completion order
        prompt, category = ids[d.index], prompts[d.index].category
        tokens = torch.tensor([*prompt, *d.answer])
        lo = max(0, len(tokens) - args.max_len) if args.max_len else 0  # the tail, as load_sequences
        out.append(Answer(category, tokens[lo:], d.features[lo:], max(len(prompt) - lo, 1)))
    return out


@torch.inference_mode()
def score(head, lm_head: torch.Tensor, a: Answer, tally: Tally) -> None:
    """Adds one answer's per-position hits and simulated chain rounds to ``tally``."""
    outs = head_unroll(head, a.features[None, :-1].float(), a.tokens[None, 1 : len(a.features)], STEPS)
    # preds[s - 1][i]: step s's token for position i + 2, from the chain rooted at position i - s + 2
    preds = [(head.logit_input(o[0]) @ lm_head.T).argmax(-1) for o in outs]
    p, n = a.prompt_len, len(a.tokens) - a.prompt_len

    def hit(root: int, s: int) -> bool:  # root: the round's last known token's position
        i = root + s - 2
        return 0 <= i < len(preds[s - 1]) and int(preds[s - 1][i]) == int(a.tokens[root + s])

    for j in range(1, n):  # answer token j is predicted from root p + j - s at step s
        for s in range(1, min(j, STEPS) + 1):  # a chain rooted at an answer token
            tally.scored[s - 1] += 1
            tally.hits[s - 1] += hit(p + j - s, s)
    for depth in (1, STEPS):
        for k in replay(lambda r, s: hit(p + r, s), n, depth):
            tally.rounds[depth] += 1
            for d in range(1, k + 1):
                tally.accepted[depth, d] += 1


def proposal_acceptance(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float
) -> tuple[float, float]:
    """Summed over positions ([n, V] logits each): the chance the verify accepts the draft's most
    likely token, p(argmax q), and a token drawn from q, sum min(p, q) -- p and q the softmaxes at
    ``temperature``."""
    p = torch.softmax(target_logits.float() / temperature, -1)
    q = torch.softmax(draft_logits.float() / temperature, -1)
    point = p.gather(-1, q.argmax(-1, keepdim=True)).sum()
    return float(point), float(torch.minimum(p, q).sum())


@torch.inference_mode()
def sampled_row(head, lm_head: torch.Tensor, answers: list[Answer], temperature: float) -> str:
    """One head's first-token acceptance at ``temperature`` over every answer position, as a
    table row: positions | most likely | drawn."""
    point = drawn = 0.0
    n = 0
    for a in answers:
        feats = a.features.float()
        out = head_unroll(head, feats[None, :-1], a.tokens[None, 1 : len(a.features)], 1)[0][0]  # [T - 1, D]
        lo = a.prompt_len - 1  # draft row i predicts token i + 2, as the target's row i + 1 does
        q_logits = head.logit_input(out[lo:]) @ lm_head.T
        pt, dr = proposal_acceptance(feats[lo + 1 :] @ lm_head.T, q_logits, temperature)
        point, drawn, n = point + pt, drawn + dr, n + q_logits.shape[0]
    return f"{n} | {point / max(n, 1):.3f} | {drawn / max(n, 1):.3f}"


def replay(hit: Callable[[int, int], bool], n: int, depth: int) -> list[int]:
    """Accepted drafts per round of ``depth``-token chains over an ``n``-token answer.

    ``hit(r, s)``: the chain rooted at answer token r has its s-th token right. The first answer
    token comes from the prefill; each round roots at the last known token, accepts the chain's
    longest right prefix, and the verify adds one token of its own."""
    out, r = [], 0
    while r + 1 < n:
        k = 0
        while k < depth and r + k + 1 < n and hit(r, k + 1):
            k += 1
        out.append(k)
        r += k + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+", help="EAGLE-2 head folders")
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or a prompts JSONL)")
    ap.add_argument("--per-category", type=positive_int, default=4)
    ap.add_argument("--max-new-tokens", type=positive_int, default=64)
    ap.add_argument("--categories", nargs="+", help="only these prompt categories (default: all)")
    ap.add_argument(
        "--max-len",
        type=positive_int,
        help="keep each sequence's last N positions, as train-draft keeps max_seq_len (576) of them: "
        "is a long context itself what the head reads worse? (default: whole sequences)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="answers sampled at T (seeded), and first-token acceptance at T of the most likely and of "
        "a drawn token (default 0: greedy answers)",
    )
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4", help="the target's weight format")
    args = ap.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(args.target, weights=args.weights, progress=False)
    answers = target_answers(args, loaded)
    lm_head = loaded.model.lm_head.weight.detach()
    print(f"{len(answers)} prompts x <= {args.max_new_tokens} answer tokens ({args.data})")
    print(
        "| head | prompts | positions | agreement, steps 1 / 2 / 3 | 1-token chains: MAL (d=1) "
        "| 3-token chains: MAL (d=1 / 2 / 3) |\n|---|---|---|---|---|---|"
    )
    for folder in args.heads:
        head = load_eagle(folder).attach(loaded.model)
        tallies: dict[str, Tally] = defaultdict(Tally)
        for a in answers:
            score(head, lm_head, a, tallies["all"])
            score(head, lm_head, a, tallies[a.category])
        for name in ["all", *sorted(k for k in tallies if k != "all")]:
            t = tallies[name]
            print(f"| {folder} | {name} | {t.scored[0]} | {t.row()} |")
    if args.temperature > 0:
        print(
            f"\nFirst drafted token accepted at T={args.temperature}, teacher-forced, step 1:\n"
            "| head | positions | most likely proposed | drawn from the draft |\n|---|---|---|---|"
        )
        for folder in args.heads:
            head = load_eagle(folder).attach(loaded.model)
            print(f"| {folder} | {sampled_row(head, lm_head, answers, args.temperature)} |")


if __name__ == "__main__":
    main()

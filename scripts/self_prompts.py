"""User prompts written by the target itself, for draft-head training data (Magpie-style).

The chat template is rendered up to where a user's message begins, and the target samples
what follows (temperature ``--temperature``, nucleus ``--top-p``) until its end-of-turn: an
instruct model writes the kind of request it was tuned to answer. Prompts are deduplicated
(case and spacing folded), kept between ``--min-words`` and ``--max-tokens`` long, and written as
JSONL ``{"prompt": ...}``, the format ``evospec train-draft --data`` reads as generation prompts.
No data set is read, so none of the evaluation sets can leak in. Resumable: an existing
``--out`` is kept and extended. Used for draft head version 5 (docs/draft-head.md):

    .venv/bin/python scripts/self_prompts.py --count 3000 --out ~/.cache/evospec/self_prompts.jsonl

With ``--steer``, each attempt starts the user's message with the next of a fixed list of
openers (``OPENERS``: the kinds of request a chat benchmark holds -- writing, role-play,
reasoning, math, code, extraction, science, humanities, short factual questions) and the target
writes the rest, so the prompts cover those kinds evenly instead of the model's favourites:

    .venv/bin/python scripts/self_prompts.py --steer --batch-size 16 --count 1000 \\
        --out ~/.cache/evospec/steered_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from evospec.assembly import StackSettings, assemble
from evospec.decoding.sampling import SamplingParams, target_probs
from evospec.train.batch_generate import greedy_stream

MARK = "\x00USER\x00"
OPENERS = (
    "Write a blog post about",
    "Compose a short story",
    "Draft an email to",
    "Write a persuasive essay",
    "Write a poem about",
    "Write a product description for",
    "Pretend you are",
    "Act as a",
    "Imagine you are",
    "You are a",
    "Suppose that",
    "If a",
    "Here is a riddle:",
    "Solve",
    "What is the value of",
    "Find the",
    "Calculate",
    "Write a Python function that",
    "Implement a",
    "Write a SQL query",
    "Write a program",
    "Extract",
    "From the following text,",
    "Identify the",
    "Explain how",
    "What is the difference between",
    "Describe the process of",
    "In physics,",
    "Discuss",
    "What were the causes of",
    "Analyze",
    "Who",
    "When did",
    "Where is",
    "What is",
    "How many",
)


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def _opener(args: argparse.Namespace, attempt: int) -> str:
    return OPENERS[attempt % len(OPENERS)] if args.steer else ""


def _tries(stack, decoder, prefix: list[int], args: argparse.Namespace):
    """One attempt at a time, each with its own seed (how version 5's prompts were made)."""

    def run(attempt: int) -> Iterator[tuple[str, list[int]]]:
        while True:
            params = SamplingParams(
                max_new_tokens=args.max_tokens + 1,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=attempt,
            )
            opener = _opener(args, attempt)
            attempt += 1
            start_ids = prefix + stack.codec.tok.encode(opener, add_special_tokens=False).ids
            yield opener, [t for ev in decoder.generate(start_ids, params) for t in ev.tokens]

    return run


def _batched_tries(stack, prefix: list[int], args: argparse.Namespace):
    """``--batch-size`` attempts decoded together (continuous batching, one sampler stream per
    run seeded by the first attempt's number): several times the throughput on a CPU."""
    params = SamplingParams(
        max_new_tokens=args.max_tokens + 1, temperature=args.temperature, top_p=args.top_p
    )

    def run(attempt: int) -> Iterator[tuple[str, list[int]]]:
        gen = torch.Generator().manual_seed(attempt)

        def pick(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R]
            return torch.multinomial(target_probs(logits, params), 1, generator=gen)[:, 0]

        while True:
            openers = [_opener(args, attempt + i) for i in range(4 * args.batch_size)]
            starts = [prefix + stack.codec.tok.encode(o, add_special_tokens=False).ids for o in openers]
            attempt += len(starts)
            longest = max(len(x) for x in starts)
            stream = greedy_stream(
                stack.loaded.model,
                starts,
                args.max_tokens + 1,
                stack.eos_ids,
                batch_size=args.batch_size,
                cache_len=longest + 2 * (args.max_tokens + 1),
                pick=pick,
            )
            for done in stream:
                yield openers[done.index], done.answer

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=3000, help="prompts to have in --out (default 3000)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-tokens", type=int, default=96, help="longest prompt kept, in tokens")
    ap.add_argument("--min-words", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="first sampling seed (one per attempt)")
    ap.add_argument("--steer", action="store_true", help="start each prompt with the next of OPENERS")
    ap.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="attempts decoded together (default 1: one at a time, as for version 5)",
    )
    args = ap.parse_args()
    stack = assemble(StackSettings(methods=("ar",), weights=args.weights), progress=False)
    codec, decoder = stack.codec, stack.decoder("ar")
    rendered = codec.render_chat([{"role": "user", "content": MARK}])
    prefix = codec.tok.encode(rendered[: rendered.index(MARK)], add_special_tokens=False).ids
    kept = (
        [json.loads(line)["prompt"] for line in args.out.read_text().splitlines()]
        if args.out.exists()
        else []
    )
    seen = {_key(p) for p in kept}
    # a resumed run starts past the seeds the first one most likely tried (~1.15 tries per kept
    # prompt here); a prompt drawn again is dropped by the deduplication anyway
    attempt, start = args.seed + len(kept) * 2, time.time()
    tries = (
        _batched_tries(stack, prefix, args) if args.batch_size > 1 else _tries(stack, decoder, prefix, args)
    )
    with args.out.open("a") as out:
        for opener, ids in tries(attempt):
            finished = bool(ids) and ids[-1] in stack.eos_ids
            text = (opener + codec.decode(ids)).strip()
            if not finished or len(text.split()) < args.min_words or _key(text) in seen:
                continue
            seen.add(_key(text))
            kept.append(text)
            out.write(json.dumps({"prompt": text}) + "\n")
            out.flush()
            if len(kept) % 50 == 0:
                rate = len(kept) / (time.time() - start)
                print(f"{len(kept)}/{args.count} prompts ({rate:.1f}/s)", file=sys.stderr)
            if len(kept) >= args.count:
                break
    print(f"{len(kept)} prompts in {args.out}")


if __name__ == "__main__":
    main()

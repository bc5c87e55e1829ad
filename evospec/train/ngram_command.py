"""``evospec build-ngrams``: count the target's own answers into its n-gram table.

Owns the sub-parser and the build: read the answers ``train-draft`` generated
(``<work>/generations.jsonl``), count them (``decoding/ngram_table.py``) and save the table
with its build record, by default where serving looks first (``ngram_table.user_table_path``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from evospec.common import check_output, evospec_home
from evospec.models.registry import DEFAULT_MODEL

PROMPT_TAIL = 3  # prompt tokens kept before each answer: the chat template's assistant header


def add_build_ngrams_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "build-ngrams",
        help="count a target's own answers into the n-gram table that --table-lookup reads",
        description="Count the answers the target generated for training prompts (evospec train-draft "
        "--generate-only writes them to <work>/generations.jsonl) into a table of next-token guesses: "
        "for every context of 1..--max-order tokens seen at least --min-count times, its most "
        "frequent next token and that token's share. Serving reads the table (--ngrams; default: "
        "this command's output for the model, else the one shipped) where --table-lookup is on: a "
        "round whose context lookup finds nothing verifies the table's guess instead of drafting. "
        "Output never depends on the table.",
    )
    t.add_argument("--target", default=DEFAULT_MODEL, help=f"target model (default: {DEFAULT_MODEL})")
    t.add_argument(
        "--work",
        type=Path,
        default=None,
        help="train-draft's work folder holding generations.jsonl (default: $EVOSPEC_HOME/train/<target>)",
    )
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="table file (default: $EVOSPEC_HOME/ngrams/<target>.safetensors)",
    )
    t.add_argument(
        "--include-dataset",
        action="store_true",
        help="also count the datasets' own (teacher-forced) answers (default: only the target's own "
        "answers, which are what it will write)",
    )
    t.add_argument("--max-order", type=int, default=4, help="longest context counted (default: 4)")
    t.add_argument(
        "--min-count", type=int, default=2, help="contexts seen fewer times are left out (default: 2)"
    )
    t.add_argument(
        "--min-share",
        type=float,
        default=0.3,
        help="the table guesses only where the next token had at least this share (default: 0.3)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_build_ngrams)


def answers(path: Path, include_dataset: bool) -> Iterator[list[int]]:
    """Prompt tail + answer ids of each finished sequence in a ``generations.jsonl``."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("teacher_forced") and not include_dataset:
                continue
            yield [*rec["prompt_ids"][-PROMPT_TAIL:], *rec["response_ids"]]


def cmd_build_ngrams(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from evospec.decoding.ngram_table import NgramTable, user_table_path
    from evospec.models.loading import load_model

    check_output(args.out, "--out")
    loaded = load_model(args.target, progress=not args.no_progress)
    work = args.work or evospec_home() / "train" / loaded.name
    files = [work / "generations.jsonl"]
    if args.include_dataset:
        files.append(work / "teacher" / "generations.jsonl")
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(
            f"no generated answers in {work}: run `evospec train-draft --target {args.target} "
            f"--generate-only --tokens 500000` first (or give --work)"
        )
    with tqdm(desc="counting", unit=" answers", disable=args.no_progress) as bar:

        def sequences() -> Iterator[list[int]]:
            for f in files:
                for seq in answers(f, args.include_dataset):
                    bar.update()
                    yield seq

        table = NgramTable.count(
            sequences(),
            model=loaded.name,
            vocab_size=loaded.model.cfg.vocab_size,
            max_order=args.max_order,
            min_count=args.min_count,
            min_share=args.min_share,
            source=", ".join(f"{f.relative_to(work)} in {work.name}" for f in files),
        )
    out = args.out or user_table_path(loaded.name)
    table.save(out)
    info = table.info
    print(
        f"{out}: {len(table):,} contexts from {info.tokens:,} tokens in {info.sequences:,} answers "
        f"(orders 1..{info.max_order}, seen >= {info.min_count} times; "
        f"guesses with share >= {info.min_share})",
        file=sys.stderr,
    )
    return 0

"""The ``evospec`` command line: generate, bench, train-draft, train-vocab, build-ngrams, serve, models.

Owns: the top-level parser and the dispatch. Each command module registers its own
sub-parser (``add_*_parser``) and handler; shared knobs live in ``options.py``; what the
commands load comes from ``assembly.py``.
"""

from __future__ import annotations

import argparse
import sys

from evospec.bench.command import add_bench_parser
from evospec.generate import add_generate_parser
from evospec.models.command import add_models_parser
from evospec.train.command import add_train_draft_parser
from evospec.train.ngram_command import add_build_ngrams_parser
from evospec.train.vocab_command import add_train_vocab_parser
from service.command import add_serve_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evospec",
        description="Speculative decoding with an adaptive draft. Output is identical to plain decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_generate_parser,
        add_bench_parser,
        add_train_draft_parser,
        add_train_vocab_parser,
        add_build_ngrams_parser,
        add_serve_parser,
        add_models_parser,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from evospec.models.errors import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError, OSError) as exc:  # OSError: a path it cannot read or write
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

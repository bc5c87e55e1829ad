"""How much ``--method auto``'s final moves from run to run in one process.

Assembles AR and the named methods at their ``--tree auto`` shapes (tuned, or read from the
tuning cache), then plays ``decoding/tune.py``'s ``final`` between them ``--repeat`` times on its
own prompts, printing each run's speedups over AR. Used for docs/benchmarks.md, wave 30:

    .venv/bin/python scripts/method_final.py --methods ngram eagle2 --repeat 5
"""

from __future__ import annotations

import argparse

from evospec import options
from evospec.assembly import assemble
from evospec.cli import build_parser
from evospec.decoding import tune


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["ngram", "eagle2"], help="the finalists")
    p.add_argument("--repeat", type=int, default=5, help="finals to play (default 5)")
    p.add_argument("--rounds", type=int, default=tune.FINAL_ROUNDS, help="rounds a final (as served)")
    args = p.parse_args()
    gen = build_parser().parse_args(["generate", "--tree", "auto", "x"])  # the CLI's defaults
    stack = assemble(options.stack_settings(gen, ["ar", *args.methods]), progress=True)
    codec = stack.loaded.codec
    prompts = [codec.encode_chat([{"role": "user", "content": t}]) for t in tune.FINAL_TEXTS]
    entrants = {name: stack.decoder(name) for name in args.methods}
    for i in range(args.repeat):
        speedups = tune.final(stack.decoder("ar"), entrants, prompts, rounds=args.rounds, progress=False)
        print(f"final {i + 1}: " + ", ".join(f"{n} {x:.3f}x" for n, x in speedups.items()), flush=True)
    for dec in stack.decoders.values():
        dec.close()


if __name__ == "__main__":
    main()

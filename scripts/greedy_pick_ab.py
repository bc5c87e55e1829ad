"""Whole decodes with greedy picks through numpy's argmax (``sampling.greedy_ids``) or torch's
``max``, the two swapped in one process and alternated prompt by prompt.

Decodes ``tune.FINAL_TEXTS`` with AR and ngram (the CLI's defaults), ``--rounds`` times, each
prompt by both picks in an order that flips from prompt to prompt; prints decode tok/s for each
pick and whether the tokens are equal. Used for docs/benchmarks.md, wave 30:

    .venv/bin/python scripts/greedy_pick_ab.py --rounds 4
"""

from __future__ import annotations

import argparse

from evospec import options
from evospec.assembly import assemble
from evospec.cli import build_parser
from evospec.decoding import sampling, tune, verify
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams

PICKS = {"torch max": lambda logits: logits.max(dim=-1).indices, "numpy argmax": sampling.greedy_ids}


def use(pick) -> None:
    sampling.greedy_ids = verify.greedy_ids = pick  # every greedy choice reads one of these names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    stack = assemble(options.stack_settings(build_parser().parse_args(["generate", "x"]), ["ar", "ngram"]))
    record_steps(stack.loaded.model, stack.decoders.values())
    prompts = [stack.loaded.codec.encode_chat([{"role": "user", "content": t}]) for t in tune.FINAL_TEXTS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for name, dec in stack.decoders.items():
        seconds, tokens, outputs = dict.fromkeys(PICKS, 0.0), dict.fromkeys(PICKS, 0), {}
        for r in range(args.rounds):
            for j, ids in enumerate(prompts):
                for pick in list(PICKS)[:: 1 if (r + j) % 2 == 0 else -1]:
                    use(PICKS[pick])
                    out = []
                    for ev in dec.generate(ids, params):
                        if not ev.prefill:
                            seconds[pick] += ev.round_s or ev.verify_s
                            tokens[pick] += len(ev.tokens)
                        out += ev.tokens
                    outputs.setdefault(pick, {})[j] = out
        speed = {pick: tokens[pick] / seconds[pick] for pick in PICKS}
        same = outputs["torch max"] == outputs["numpy argmax"]
        rates = ", ".join(f"{k} {v:.1f} tok/s" for k, v in speed.items())
        print(f"{name}: {rates}, same tokens {same}")
    use(PICKS["numpy argmax"])


if __name__ == "__main__":
    main()

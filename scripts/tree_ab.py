"""Interleaved A/B of decoder variants against plain decoding, prompt by prompt.

Each variant is ``METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB][@HEAD][%TABLE]`` (a
1-wide chain of DEPTH drafted tokens, or with MIN_PROB as many as stay that likely, ``--min-prob``;
DEPTH may be ``KxD`` or ``KxDxT``: a tree of top_k K, depth D and T tokens, K x D by default;
TABLE_LOOKUP 0 also means no n-gram table; ``@HEAD``: this EAGLE-2 head folder instead of the
shipped one, to A/B two heads in one run; ``%TABLE``: this n-gram table file instead of the
model's, to A/B two tables). Every prompt runs AR and every
variant back to back, the order flipping between prompts, so that this machine's bursts of
noise hit all sides alike; the report is the median of per-prompt speed ratios (decode only,
prefill excluded), MAL, and the share of rounds that verified model-free proposals. Every
output is checked equal to AR's. Used for docs/benchmarks.md, wave 8:

    .venv/bin/python scripts/tree_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        ngram:3:2:0:1 ngram:3:2:1:1 frspec:3:2:0:1 frspec:3:2:1:1

and for wave 10 (two heads): ``frspec:3:2:1:1@OLD_HEAD frspec:3:2:1:1@NEW_HEAD``; two
tables: ``ngram:3:2:1:1%OLD.safetensors ngram:3:2:1:1%NEW.safetensors``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.methods import make_decoder
from evospec.decoding.ngram_table import load_ngram_table
from evospec.decoding.recording import record_steps
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree_config import TreeConfig
from evospec.models.eagle import load_eagle


def variant_tree(spec: str) -> tuple[str, TreeConfig]:
    method, lookup, ngram, table, depth, *stop = spec.split("%")[0].split("@")[0].split(":")
    shape = [int(x) for x in depth.split("x")]  # DEPTH, or TOP_KxDEPTH[xTOTAL]
    k, d = (1, shape[0]) if len(shape) == 1 else shape[:2]
    total = shape[2] if len(shape) > 2 else k * d
    tree = TreeConfig(
        k,
        d,
        total,
        lookup=int(lookup),
        lookup_ngram=int(ngram),
        table_lookup=int(table),
        min_prob=float(stop[0]) if stop else 0.0,
    )
    return method, tree


def variant_parser(doc: str, variants_help: str, per_category: int) -> argparse.ArgumentParser:
    """The command line this script and ``round_costs.py`` share: variants, prompts, format."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help=variants_help)
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--per-category", type=int, default=per_category)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--weights", default="int4")
    return ap


def variant_setup(args: argparse.Namespace, names: dict[str, str] | None = None):
    """What ``round_costs.py``, ``round_overhead.py`` and ``drafting_ab.py`` start from: two
    threads, the stack, AR and one decoder per variant (``names``: decoder name -> variant;
    default: every variant of ``args`` under its own name) on the shipped head and table, their
    graphs recorded; the prompts as chat ids; the sampling parameters. Returns (stack,
    decoders, prompts, params)."""
    torch.set_num_threads(2)
    names = names or {v: v for v in args.variants}
    methods = tuple(dict.fromkeys(variant_tree(v)[0] for v in names.values()))
    stack = assemble(StackSettings(methods=("ar", *methods), weights=args.weights), progress=False)
    decoders = {"ar": stack.decoder("ar")}
    for name, v in names.items():
        method, tree = variant_tree(v)
        decoders[name] = make_decoder(
            method,
            stack.loaded.model,
            eos_ids=stack.eos_ids,
            draft=stack.draft,
            tree=tree,
            indices=stack.indices,
            ngrams=stack.ngrams if tree.table_lookup else None,
        )
    record_steps(stack.loaded.model, decoders.values())
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    return stack, decoders, prompts, SamplingParams(max_new_tokens=args.max_new_tokens)


def interleave(names: list[str], prompts: list[list[int]], run) -> None:
    """Every prompt on every decoder (``names``, "ar" among them), the order rotating between
    prompts, after one warm-up run each that records nothing; ``run(name, ids, record)`` decodes
    and returns the output ids, each checked equal to AR's (what ``round_costs.py`` and
    ``round_overhead.py`` time)."""
    for name in names:  # warm-up: allocation, kernel selection
        run(name, prompts[0], False)
    for i, ids in enumerate(prompts):
        k = i % len(names)
        outs = {n: run(n, ids, True) for n in names[k:] + names[:k]}
        for n in names:
            if outs[n] != outs["ar"]:
                raise SystemExit(f"{n}: output differs from AR on prompt {i}")


def main() -> None:
    ap = variant_parser(__doc__, "METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB][@HEAD][%TABLE]", 2)
    ap.add_argument("--model", default=None, help="target model (default: the default model)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    methods = tuple(dict.fromkeys(variant_tree(v)[0] for v in args.variants))
    model = {"model": args.model} if args.model else {}
    stack = assemble(StackSettings(methods=("ar", *methods), weights=args.weights, **model), progress=False)
    decoders = {"ar": stack.decoder("ar")}
    heads, tables = {}, {}  # folder -> head, file -> table, each loaded once
    vocab = stack.loaded.model.cfg.vocab_size
    for v in args.variants:
        method, tree = variant_tree(v)
        spec, _, table_file = v.partition("%")
        if table_file and table_file not in tables:
            tables[table_file] = load_ngram_table(table_file, vocab)
        table = (tables[table_file] if table_file else stack.ngrams) if tree.table_lookup else None
        folder = spec.partition("@")[2]
        if folder and folder not in heads:
            heads[folder] = load_eagle(folder, dtype=stack.draft.fc.weight.dtype)
        decoders[v] = make_decoder(
            method,
            stack.loaded.model,
            eos_ids=stack.eos_ids,
            draft=heads[folder] if folder else stack.draft,
            tree=tree,
            indices=stack.indices,
            ngrams=table,
        )
    record_steps(stack.loaded.model, decoders.values())
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def run(name: str, ids: list[int]):
        out, rounds, accepted, free, t0 = [], 0, 0, 0, time.perf_counter()
        for ev in decoders[name].generate(ids, params):
            if ev.prefill:
                t0 = time.perf_counter()
            else:
                rounds, accepted, free = rounds + 1, accepted + ev.accepted, free + ev.looked_up
            out += ev.tokens
        return out, (len(out) - 1) / (time.perf_counter() - t0), accepted, rounds, free

    for name in decoders:  # warm-up
        run(name, prompts[0])
    names = list(decoders)
    ratios, speed = collections.defaultdict(list), collections.defaultdict(list)
    totals = collections.defaultdict(lambda: [0, 0, 0])
    for i, ids in enumerate(prompts):
        res = {n: run(n, ids) for n in (names if i % 2 == 0 else names[::-1])}
        for n in names:
            speed[n].append(res[n][1])
            if n == "ar":
                continue
            if res[n][0] != res["ar"][0]:
                raise SystemExit(f"{n}: output differs from AR on prompt {i}")
            ratios[n].append(res[n][1] / res["ar"][1])
            for j in range(3):
                totals[n][j] += res[n][2 + j]
    print(
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens; "
        f"AR median {statistics.median(speed['ar']):.1f} tok/s"
    )
    print("| variant | median ratio vs AR | MAL | model-free rounds |\n|---|---|---|---|")
    for n in names[1:]:
        acc, rounds, free = totals[n]
        print(f"| {n} | {statistics.median(ratios[n]):.3f} | {1 + acc / rounds:.3f} | {free / rounds:.2f} |")


if __name__ == "__main__":
    main()

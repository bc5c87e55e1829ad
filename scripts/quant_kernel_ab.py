"""The quantised kernels side by side, on the default model in one process: torch's (bf16
activations) and ours (AVX-512 VNNI, int8 activations, ``evospec/kernels/int4_matmul.py`` for
the int4 body, ``int8_matmul.py`` for the int8 LM head). ``--kernels`` names the stacks
compared, the first being the reference: ``torch`` (both torch's), ``vnni-int4`` (our int4
body, torch's int8 LM head: wave 11's default) and ``vnni`` (both ours).

``--mode speed``: both models loaded; every Spec-Bench prompt runs AR and each variant
(``scripts/tree_ab.py``'s ``METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH``) on both kernels,
the order flipping between prompts; prints the median per-prompt decode speed relative to the
first stack's AR, MAL and the median prefill time. Each variant's output is checked equal to
its own kernel's AR. ``--mode fidelity``: teacher-forced on the AR answers of the same prompts,
next-token agreement and KL of each kernel against the fp32 model. ``--mode linears``: the 120
linears of SmolLM2's 30 layers (random codes) at 1..64 rows, medians of 9 passes. Used for
docs/benchmarks.md, waves 11 and 12:

    .venv/bin/python scripts/quant_kernel_ab.py --data ../shared/data/spec_bench/question.jsonl
    .venv/bin/python scripts/quant_kernel_ab.py --data ../shared/data/spec_bench/question.jsonl --mode fidelity
    .venv/bin/python scripts/quant_kernel_ab.py --mode linears
    .venv/bin/python scripts/quant_kernel_ab.py --data ../shared/data/spec_bench/question.jsonl \
        --kernels vnni-int4,vnni
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tree_ab import variant_tree

from evospec.assembly import StackSettings, assemble
from evospec.decoding.recording import record_steps
from evospec.bench.prompts import load_prompts
from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.models import quant
from evospec.models.quant import QUANT_KERNEL_ENV

KERNELS = ("torch", "vnni-int4", "vnni")


def load(kernel: str, weights: str = "int4", methods: tuple[str, ...] = ("ar",)):
    os.environ[QUANT_KERNEL_ENV] = "torch" if kernel == "torch" else "vnni"
    choose = quant.quant_kernel
    if kernel == "vnni-int4":  # Int8Matmul (the LM head) chooses torch's; set at load, before steps are recorded
        quant.quant_kernel = lambda n: "torch" if sys._getframe(1).f_code.co_qualname == "Int8Matmul.__init__" else choose(n)
    try:
        return assemble(StackSettings(methods=methods, weights=weights), progress=False)
    finally:
        del os.environ[QUANT_KERNEL_ENV]
        quant.quant_kernel = choose


def speed(args: argparse.Namespace) -> None:
    methods = tuple(dict.fromkeys(variant_tree(v)[0] for v in args.variants))
    decoders = {}
    kernels = args.kernels
    for kernel in kernels:
        stack = load(kernel, methods=("ar", *methods))
        for v in args.variants:
            method, tree = variant_tree(v)
            table = stack.ngrams if tree.table_lookup else None
            decoders[kernel, v] = make_decoder(
                method, stack.loaded.model, eos_ids=stack.eos_ids, draft=stack.draft, tree=tree,
                indices=stack.indices, ngrams=table,
            )  # fmt: skip
        decoders[kernel, "ar"] = stack.decoder("ar")
        record_steps(stack.loaded.model, [d for (k, _), d in decoders.items() if k == kernel])
    codec = stack.codec
    prompts = [
        codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def run(key, ids):
        out, rounds, accepted, prefill, t0 = [], 0, 0, 0.0, time.perf_counter()
        for ev in decoders[key].generate(ids, params):
            if ev.prefill:
                prefill, t0 = time.perf_counter() - t0, time.perf_counter()
            else:
                rounds, accepted = rounds + 1, accepted + ev.accepted
            out += ev.tokens
        return out, (len(out) - 1) / (time.perf_counter() - t0), accepted, rounds, prefill

    keys = sorted(decoders, key=lambda k: (kernels.index(k[0]), k[1] != "ar"))
    base, other = kernels[0], kernels[-1]
    for key in keys:  # warm-up
        run(key, prompts[0])
    ratio, prefill = collections.defaultdict(list), collections.defaultdict(list)
    totals, same = collections.defaultdict(lambda: [0, 0]), 0
    for i, ids in enumerate(prompts):
        res = {key: run(key, ids) for key in (keys if i % 2 == 0 else keys[::-1])}
        for kernel, name in keys:
            if res[kernel, name][0] != res[kernel, "ar"][0]:
                raise SystemExit(f"{kernel} {name}: output differs from its AR on prompt {i}")
        same += res[base, "ar"][0] == res[other, "ar"][0]
        for key in keys:
            ratio[key].append(res[key][1] / res[base, "ar"][1])
            prefill[key].append(res[key][4])
            totals[key][0] += res[key][2]
            totals[key][1] += res[key][3]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens; {base} and {other} AR outputs agree on {same}")
    print(f"| kernels | variant | decode speed vs {base} AR | MAL | median prefill ms |")
    print("|---|---|---|---|---|")
    for key in keys:
        acc, rounds = totals[key]
        mal = 1 + acc / max(rounds, 1)
        print(
            f"| {key[0]} | {key[1]} | {statistics.median(ratio[key]):.3f} | {mal:.3f} "
            f"| {statistics.median(prefill[key]) * 1e3:.1f} |"
        )


def fidelity(args: argparse.Namespace) -> None:
    models = {"fp32": load("torch", weights="fp32")}
    models |= {f"int4-{k}": load(k) for k in args.kernels}
    first = models[f"int4-{args.kernels[0]}"]
    codec, ar = first.codec, first.decoder("ar")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    stats = {name: [0, 0, 0.0] for name in models if name != "fp32"}
    with torch.inference_mode():
        for p in load_prompts(args.data, per_category=args.per_category):
            ids = codec.encode_chat([{"role": "user", "content": p.text}])
            seq = ids + [t for ev in ar.generate(ids, params) for t in ev.tokens]
            logp = {}
            for name, stack in models.items():
                m = stack.loaded.model
                out = m(torch.tensor([seq]), torch.arange(len(seq)), m.new_cache(len(seq) + 1), logits="all")
                logp[name] = torch.log_softmax(out.logits[0, len(ids) - 1 : -1].float(), -1)
            ref = logp["fp32"]
            for name, s in stats.items():
                s[0] += int((logp[name].argmax(-1) == ref.argmax(-1)).sum())
                s[1] += ref.shape[0]
                s[2] += float((ref.exp() * (ref - logp[name])).sum())
    for name, (agree, n, kl) in stats.items():
        print(f"{name}: next-token agreement with fp32 {agree / n:.4f} over {n} positions, KL {kl / n:.4f}")


def linears(args: argparse.Namespace) -> None:
    from evospec.kernels.int4_matmul import int4_matmul, pack_int4, vnni_available
    from evospec.models.quant import GroupCodes, Int4Matmul

    if not vnni_available():
        raise SystemExit("no AVX-512 VNNI int4 kernel on this machine")
    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
    weights = [(GroupCodes.from_float(torch.randn(n, k)), n, k) for _ in range(30) for n, k in shapes]
    os.environ[QUANT_KERNEL_ENV] = "torch"
    torch_mm = [Int4Matmul(codes, None, [n]) for codes, n, _ in weights]
    del os.environ[QUANT_KERNEL_ENV]
    packed = [pack_int4(c.codes, c.scale, c.zero - 8 * c.scale) for c, _, _ in weights]
    print("| rows | torch ms | vnni ms | torch / vnni |\n|---|---|---|---|")
    for m in (1, 2, 4, 8, 16, 64):
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, k in shapes}
        best = {}
        for name in ("torch", "vnni"):
            runs = []
            for _ in range(9):
                t0 = time.perf_counter()
                for i, (_, _, k) in enumerate(weights):
                    torch_mm[i](xs[k]) if name == "torch" else int4_matmul(xs[k], packed[i])
                runs.append(time.perf_counter() - t0)
            best[name] = statistics.median(runs) * 1e3
        print(f"| {m} | {best['torch']:.2f} | {best['vnni']:.2f} | {best['torch'] / best['vnni']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", default=["ngram:3:2:1:1", "frspec:3:2:0:1", "frspec:3:2:1:1"])
    ap.add_argument("--mode", choices=("speed", "fidelity", "linears"), default="speed")
    ap.add_argument("--data", help="Spec-Bench question.jsonl (or prompts JSONL); speed and fidelity")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--kernels", default="torch,vnni", help=f"comma-separated, the first the reference: {KERNELS}")
    args = ap.parse_args()
    args.kernels = args.kernels.split(",")
    if not set(args.kernels) <= set(KERNELS) or len(args.kernels) < 2:
        ap.error(f"--kernels: two or more of {', '.join(KERNELS)}")
    torch.set_num_threads(2)
    if args.mode != "linears" and not args.data:
        ap.error(f"--mode {args.mode} needs --data")
    {"speed": speed, "fidelity": fidelity, "linears": linears}[args.mode](args)


if __name__ == "__main__":
    main()

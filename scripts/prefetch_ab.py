"""Interleaved A/B of the op library's prefetch settings, for plain decoding and decoder variants.

Each ``--hints`` entry is ``STREAMED[/KEPT][@KV]`` (``kernels/prefetch.py``: STREAMED the setting
of the target's weights, read once a step, ``HINT[:KIB]``; KEPT the hint of a draft's, read again
soon, default t0; KV how many keys ahead the attention prefetches keys and values, default
64). Every prompt runs, under every entry in turn (the order rotating between prompts), AR and
every variant (``scripts/tree_ab.py``'s syntax); outputs are checked equal to AR's under every
entry. Reports decode tok/s (prefill excluded) per entry and decoder, each
decoder's speed against AR under the same entry, and every entry's speed against the first
one's, decoder by decoder. Used for docs/benchmarks.md, waves 45 and 46:

    .venv/bin/python scripts/prefetch_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 1 --hints nta t0 t1 t0/t1 -- ngram:3:2:1:1 frspec:3:2:0:2
    .venv/bin/python scripts/prefetch_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 1 --hints t0 t1 t1:10 -- ngram:3:2:1:1 frspec:3:2:1:1
    .venv/bin/python scripts/prefetch_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 2 --hints t1:10@0 t1:10@64 -- ngram:3:2:1:1 frspec:3:2:1:1
"""

from __future__ import annotations

import collections
import time

from tree_ab import variant_parser, variant_setup

from evospec.kernels import prefetch


def hint_pair(text: str) -> tuple[prefetch.Setting, str, int]:
    """``STREAMED[/KEPT][@KV]`` -> (streamed setting, kept hint, keys ahead); ValueError for an
    unknown hint or a distance the ops cannot take."""
    text, at, kv = text.partition("@")
    streamed, _, kept = text.partition("/")
    kept = kept or prefetch.KEPT_DEFAULT
    if kept not in prefetch.HINTS:
        raise ValueError(f"{text!r}: {kept!r} is not one of {list(prefetch.HINTS)}")
    keys = int(kv) if at else prefetch.KV_AHEAD_DEFAULT
    if not 0 <= keys <= 4096:
        raise ValueError(f"{text}@{kv}: the attention prefetches 0..4096 keys ahead")
    return prefetch.Setting.parse(streamed), kept, keys


def use(entry: tuple[prefetch.Setting, str, int]) -> None:
    """Prefetch as ``entry`` says: the streamed setting, the kept hint, the keys ahead."""
    prefetch.set_hints(entry[0].hint, entry[1])
    prefetch.apply(entry[0])
    prefetch.set_kv_ahead(entry[2])


def main() -> None:
    ap = variant_parser(__doc__, "METHOD:LOOKUP:LOOKUP_NGRAM:TABLE_LOOKUP:DEPTH[:MIN_PROB]", 1)
    ap.add_argument("--hints", nargs="+", type=hint_pair, default=["nta", "t0"], help="STREAMED[/KEPT] hints")
    args = ap.parse_args()
    hints = args.hints
    _, decoders, prompts, params = variant_setup(args)
    seconds, tokens = collections.Counter(), collections.Counter()

    def run(name: str, ids: list[int]) -> tuple[list[int], float]:
        out, t0 = [], time.perf_counter()
        for ev in decoders[name].generate(ids, params):
            out += ev.tokens
            if ev.prefill:
                t0 = time.perf_counter()
        return out, time.perf_counter() - t0

    names = list(decoders)
    for h in hints:  # warm-up under every hint
        use(h)
        for name in names:
            run(name, prompts[0])
    for i, ids in enumerate(prompts):
        k = i % len(hints)
        for h in hints[k:] + hints[:k]:
            use(h)
            outs = {}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                outs[name], s = run(name, ids)
                seconds[h, name] += s
                tokens[h, name] += len(outs[name]) - 1
            for name in names:
                if outs[name] != outs["ar"]:
                    raise SystemExit(f"{name} under {h}: output differs from AR on prompt {i}")
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    speed = {key: tokens[key] / max(seconds[key], 1e-9) for key in seconds}
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens; decode tok/s (vs AR, the same setting)")
    print("| prefetch (streamed/kept@keys ahead) | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for h in hints:
        ratio = {n: f" ({speed[h, n] / speed[h, 'ar']:.3f}x)" for n in names if n != "ar"}
        cells = [f"{speed[h, n]:.1f}{ratio.get(n, '')}" for n in names]
        print(f"| {h[0]}/{h[1]}@{h[2]} | " + " | ".join(cells) + " |")
    print(f"\nagainst {hints[0][0]}/{hints[0][1]}@{hints[0][2]}, decoder by decoder")
    for h in hints[1:]:
        ratios = ", ".join(f"{n} {speed[h, n] / speed[hints[0], n]:.3f}x" for n in names)
        print(f"{h[0]}/{h[1]}@{h[2]}: {ratios}")


if __name__ == "__main__":
    main()

"""Sampled decoding with this checkout's sampler beside the one it replaced, in one process.

The reference sampler is wave 31's: a token drawn by ``torch.multinomial`` (an exponential
drawn per id: ~1.3 ms for SmolLM2's 49,152 here), top-k by torch's ``topk`` and a masked
softmax over the row, and the top-p nucleus found by a full ``torch.sort`` of the row (~4
ms). Both samplers follow the same law (``tests/decoding/test_sampling.py``); they consume
the random stream differently, so their tokens differ and each arm is timed on its own
seeded outputs. Every method runs every prompt with both
samplers, the order flipping from prompt to prompt; prints decode tok/s per method and arm.
Used for docs/benchmarks.md, wave 32:

    .venv/bin/python scripts/sampler_ab.py --data ../shared/data/spec_bench/question.jsonl \\
        --per-category 2 --temperature 1.0 --top-p 0.95     # also --top-k 40
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import evospec.decoding.sampling as sampling
import evospec.decoding.verify as verify
from evospec.assembly import StackSettings, assemble
from evospec.bench.prompts import load_prompts
from evospec.decoding.recording import record_steps


def reference_draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def reference_target_probs(logits: torch.Tensor, params: sampling.SamplingParams) -> torch.Tensor:
    """Wave 31's ``target_probs``: torch's ``topk`` and a masked softmax over the row, then the
    nucleus from a full sort."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop = mass_before >= params.top_p
        drop[..., 0] = False
        kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = kept / kept.sum(-1, keepdim=True)
    return probs


ARMS = {
    "this": (sampling.target_probs, sampling.draw),
    "reference": (reference_target_probs, reference_draw),
}


def use(arm: str) -> None:
    """Point every caller of the sampler (plain decoding's ``pick_token``, verification's
    ``sample_accept``) at ``arm``'s distribution and draw."""
    target_probs, draw = ARMS[arm]
    sampling.target_probs = verify.target_probs = target_probs
    sampling.draw = verify.draw = draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="Spec-Bench question.jsonl (or prompts JSONL)")
    ap.add_argument("--methods", default="ar,ngram", help="comma-separated (default ar,ngram)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--weights", default="int4")
    args = ap.parse_args()
    torch.set_num_threads(2)
    methods = tuple(args.methods.split(","))
    stack = assemble(StackSettings(methods=methods, weights=args.weights), progress=False)
    decoders = {m: stack.decoder(m) for m in methods}
    record_steps(stack.loaded.model, decoders.values())
    prompts = [
        stack.codec.encode_chat([{"role": "user", "content": p.text}])
        for p in load_prompts(args.data, per_category=args.per_category)
    ]
    wall, tokens = collections.Counter(), collections.Counter()

    def run(method: str, arm: str, ids: list[int], seed: int, record: bool = True) -> None:
        use(arm)
        params = sampling.SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=seed,
        )
        n, t0 = 0, time.perf_counter()
        for ev in decoders[method].generate(ids, params):
            if ev.prefill:
                t0 = time.perf_counter()
                continue
            n += len(ev.tokens)
        if record:
            wall[method, arm] += time.perf_counter() - t0
            tokens[method, arm] += n

    runs = [(m, arm) for m in methods for arm in ARMS]
    for m, arm in runs:  # warm-up
        run(m, arm, prompts[0], 0, record=False)
    try:
        for i, ids in enumerate(prompts):
            for m, arm in runs if i % 2 == 0 else runs[::-1]:
                run(m, arm, ids, seed=i)
    finally:
        use("this")
    print(
        f"{len(prompts)} prompts x {args.max_new_tokens} tokens, "
        f"T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}"
    )
    print("| method | reference sampler, tok/s | this sampler, tok/s | ratio |")
    print("|---|---|---|---|")
    for m in methods:
        ref, this = (tokens[m, a] / wall[m, a] for a in ("reference", "this"))
        print(f"| {m} | {ref:.1f} | {this:.1f} | {this / ref:.2f} |")


if __name__ == "__main__":
    main()

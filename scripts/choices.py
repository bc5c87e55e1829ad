"""What ``n`` choices cost against one: ``evospec serve`` generating a request's choices together
(``--max-batch K``) beside a server generating them one after another (``--max-batch 1``).

Contract. This script

1. starts two ``evospec serve`` processes (free 127.0.0.1 ports, the same ``--evospec-args``):
   ``--max-batch 1`` and ``--max-batch K``; waits for both and warms each up;
2. for each of ``--prompts`` chat prompts (Spec-Bench turns from ``--data``, else the calibration
   texts), ``--rounds`` times, alternating which server goes first, sends one non-streamed
   request with ``n=1`` and one with ``n=N`` (sampled: ``--temperature``, default 1, with
   ``ignore_eos`` so every choice is ``--max-tokens`` long), timing each from send to answer;
3. prints, per server, the median seconds of an ``n=1`` and of an ``n=N`` request and their ratio
   (what N choices cost in units of one), and the batched server's ``n=N`` time against the
   one-at-a-time server's (the speed-up for users who ask for several choices); writes every
   timing to ``--out`` as JSON when given;
4. stops both servers however it ends. Exit status 0 when every request succeeded.

Usage (docs/benchmarks.md, wave 35):

    .venv/bin/python scripts/choices.py --n 4 --max-batch 4 --prompts 6 --rounds 2 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from concurrency import add_server_args, evospec_servers, load_prompts
from serve_vs_llamacpp import Server, model_id, wait_healthy


def ask(
    srv: Server, prompt: str, n: int, max_tokens: int, temperature: float, seed: int
) -> tuple[float, int]:
    """(seconds from send to answer, completion tokens) of one non-streamed chat request."""
    body = {
        "model": srv.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "seed": seed,
        "n": n,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{srv.port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        answer = json.loads(r.read())
    dt = time.perf_counter() - t0
    if len(answer["choices"]) != n:
        raise RuntimeError(f"asked for {n} choices, got {len(answer['choices'])}")
    return dt, answer["usage"]["completion_tokens"]


def summary(times: dict[str, dict[int, list[float]]], n: int) -> tuple[str, dict[str, Any]]:
    """Medians per server and choice count, the cost of n choices in units of one, and the
    batched server's n-choice time against the one-at-a-time server's."""
    names = list(times)
    med = {s: {k: statistics.median(v) for k, v in times[s].items()} for s in names}
    rows = [f"| server | n=1: s | n={n}: s | n={n} / n=1 |", "|---|---|---|---|"]
    for s in names:
        rows.append(f"| {s} | {med[s][1]:.2f} | {med[s][n]:.2f} | **{med[s][n] / med[s][1]:.2f}** |")
    first, last = names
    speedup = med[first][n] / med[last][n]
    rows.append(f"\n{n} choices, {last} against {first}: **{speedup:.2f}x** faster")
    return "\n".join(rows), {"medians": med, "speedup": speedup}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4, help="choices of the several-choice requests (default 4)")
    p.add_argument("--prompts", type=int, default=6, help="prompts (default 6)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts, alternated (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="of every request (default 1)")
    p.add_argument("--out", type=Path, default=None, help="write the timings JSON here")
    add_server_args(p)
    args = p.parse_args(argv)
    if min(args.n, args.max_batch, args.prompts, args.rounds, args.max_tokens) < 1 or args.n == 1:
        p.error("--n must be >= 2; --max-batch, --prompts, --rounds and --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    servers = evospec_servers(args, [f"--max-batch {k}" for k in (1, args.max_batch)], "evospec-choices-")
    prompts = load_prompts(args.data, args.prompts)
    times: dict[str, dict[int, list[float]]] = {s.name: {1: [], args.n: []} for s in servers}
    try:
        for srv in servers:
            srv.start()
        wait_healthy(servers, 900.0)
        for srv in servers:
            srv.model_id = model_id(srv)
            ask(srv, "Hello!", 2, 4, args.temperature, 0)  # warm-up
        for rnd in range(args.rounds):
            for i, prompt in enumerate(prompts):
                turn = rnd * len(prompts) + i
                order = servers if turn % 2 == 0 else servers[::-1]
                for srv in order:
                    for n in (1, args.n) if turn % 2 == 0 else (args.n, 1):
                        dt, tokens = ask(srv, prompt, n, args.max_tokens, args.temperature, turn)
                        times[srv.name][n].append(dt)
                        print(f"{srv.name} prompt {i} n={n}: {dt:.2f} s, {tokens} tokens", file=sys.stderr)
    finally:
        for srv in servers:
            srv.stop()
    table, result = summary(times, args.n)
    print(table)
    if args.out:
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"config": cfg, "summary": result, "times": times}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

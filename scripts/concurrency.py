"""Several clients at once against ``evospec serve``: one request at a time vs requests generated
together (``--max-batch``), side by side in one run.

Contract. This script

1. starts two ``evospec serve`` processes on free 127.0.0.1 ports with the same
   ``--evospec-args``: one with ``--baseline-args`` (default ``--max-batch 1``: requests served
   one after another, the engine's behaviour before batching) and one with ``--max-batch K``;
   waits for both to be healthy and sends each a warm-up request;
2. runs the same closed-loop workload against each, ``--rounds`` times, alternating which server
   goes first (ABBA...): ``--clients`` threads share a list of ``--requests`` prompts (Spec-Bench
   turns from ``--data``, else the calibration texts; each round its own prompts, where there
   are enough, so no round reuses another's cached slots), each thread sending its next prompt as
   soon as its previous answer ends -- streaming greedy chat requests as
   ``scripts/serve_vs_llamacpp.py`` sends them (``stream_chat``: TTFT, per-stream decode speed);
3. per server and round: aggregate throughput (completion tokens of all requests / wall time
   from the first request sent to the last answer's end), mean request latency, median TTFT,
   median per-stream decode tok/s, and the longest wait between two chunks of a stream (median
   over requests, and the worst); prints the medians over rounds, the ratios (batched / one at a
   time), and how many prompts got the same text from both servers (greedy: all of them -- the
   batch is lossless); writes everything to ``--out`` as JSON when given;
4. stops both servers however it ends. Exit status 0 when every request succeeded and every text
   matched, 1 otherwise.

Both servers run on the same cores, never at the same time. Usage (docs/benchmarks.md, wave 34):

    .venv/bin/python scripts/concurrency.py --clients 4 --max-batch 4 --requests 16 --max-tokens 64 \\
        --rounds 2 --evospec-args "--method ngram" --out /tmp/concurrency.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from serve_vs_llamacpp import Result, Server, free_port, model_id, stream_chat, wait_healthy

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def load_prompts(path: Path | None, count: int) -> list[str]:
    """``count`` prompts: the first turns of Spec-Bench's questions (one per category in turn),
    or the calibration texts where no file is given or found."""
    texts: list[str] = []
    if path is not None and path.exists():
        by_cat: dict[str, list[str]] = {}
        for line in path.read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                by_cat.setdefault(q.get("category", ""), []).append(q["turns"][0])
        while len(texts) < count and any(by_cat.values()):
            for cat in list(by_cat):
                if by_cat[cat] and len(texts) < count:
                    texts.append(by_cat[cat].pop(0))
    else:
        from evospec.decoding.tune import CALIBRATION_TEXTS

        texts = list(CALIBRATION_TEXTS)
    return [texts[i % len(texts)] for i in range(count)]


def run_load(
    srv: Server, prompts: list[str], clients: int, max_tokens: int, ignore_eos: bool, temperature: float = 0.0
) -> dict:
    """The closed-loop workload against one server: results per prompt and the wall time."""
    results: list[Result | None] = [None] * len(prompts)
    lock = threading.Lock()
    todo = list(range(len(prompts)))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            where = {"prompt_index": i, "repeat": 0, "order": 0}
            results[i] = stream_chat(srv, prompts[i], max_tokens, ignore_eos, 600.0, temperature, **where)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    ok = [r for r in done if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    speeds = [r.decode_tok_s for r in ok if r.decode_tok_s == r.decode_tok_s]  # not NaN
    gaps = [r.max_gap_s for r in ok if r.max_gap_s == r.max_gap_s]
    return {
        "wall_s": wall,
        "tokens": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else float("nan"),
        "mean_latency_s": statistics.fmean(r.total_s for r in ok) if ok else float("nan"),
        "median_ttft_s": statistics.median(r.ttft_s for r in ok) if ok else float("nan"),
        "median_stream_tok_s": statistics.median(speeds) if speeds else float("nan"),
        "median_max_gap_s": statistics.median(gaps) if gaps else float("nan"),
        "worst_gap_s": max(gaps) if gaps else float("nan"),
        "failed": len(done) - len(ok),
        "results": [asdict(r) for r in done],
    }


COLUMNS = (  # summary key, header, format
    ("throughput_tok_s", "aggregate tok/s", ".1f"),
    ("mean_latency_s", "mean request latency s", ".2f"),
    ("median_ttft_s", "median TTFT s", ".3f"),
    ("median_stream_tok_s", "median stream tok/s", ".1f"),
    ("median_max_gap_s", "median longest gap in a stream s", ".3f"),
    ("worst_gap_s", "longest gap s", ".3f"),
)


def summary_table(names: list[str], runs: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """Medians over rounds per server, and their ratios (the second server over the first)."""
    keys = [k for k, _, _ in COLUMNS]
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in keys} for n in names}
    a, b = names
    ratio = {k: med[b][k] / med[a][k] if med[a][k] else float("nan") for k in keys}
    rows = ["| server | " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for n in names:
        rows.append(f"| {n} | " + " | ".join(format(med[n][k], f) for k, _, f in COLUMNS) + " |")
    cells = [f"**{ratio[keys[0]]:.2f}**", *(f"{ratio[k]:.2f}" for k in keys[1:])]
    rows.append(f"| ratio {b} / {a} | " + " | ".join(cells) + " |")
    per_round = [f"{n}: " + " / ".join(f"{r['throughput_tok_s']:.1f}" for r in runs[n]) for n in names]
    return "\n".join([*rows, "", "aggregate tok/s by round:", *per_round]), {"medians": med, "ratio": ratio}


def _texts(runs: list[dict[str, Any]]) -> dict[tuple[int, int], str]:
    """(round, prompt index) -> the answer's text."""
    return {(k, r["prompt_index"]): r["text"] for k, run in enumerate(runs) for r in run["results"]}


def add_server_args(p: argparse.ArgumentParser) -> None:
    """The flags of the servers :func:`evospec_servers` starts and of the prompts they get."""
    p.add_argument("--max-batch", type=int, default=4, help="the batched server's --max-batch (default 4)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="Spec-Bench questions (default: shared)")
    p.add_argument("--evospec-args", default="", help='extra `evospec serve` flags, e.g. "--method ngram"')
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each server (default 2)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a temporary folder)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--requests", type=int, default=16, help="requests per workload (default 16)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--rounds", type=int, default=2, help="workloads per server, alternated (default 2)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer exactly --max-tokens long")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="of every request (default 0: greedy, answers compared between the servers; above 0 "
        "they are samples and are not compared -- add --ignore-eos for answers of equal length)",
    )
    p.add_argument(
        "--baseline-args",
        default="--max-batch 1",
        help='the first server\'s own flags (default "--max-batch 1": one request at a time); e.g. '
        '"--max-batch 4 --prefill-chunk 100000" for batching without chunked prefill',
    )
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    add_server_args(p)
    args = p.parse_args(argv)
    if min(args.clients, args.max_batch, args.requests, args.max_tokens, args.rounds) < 1:
        p.error("--clients, --max-batch, --requests, --max-tokens and --rounds must be >= 1")
    return args


def evospec_servers(args: argparse.Namespace, names: list[str], prefix: str) -> list[Server]:
    """One ``evospec serve`` (not started) per name, each with ``args.evospec_args`` and the
    name's own flags, on a free port, logging to ``args.log_dir`` (default: a new temporary
    folder starting with ``prefix``), ``args.threads`` OpenMP threads each."""
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=prefix))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    exe = [sys.executable, "-m", "evospec.cli", "serve", *shlex.split(args.evospec_args)]
    servers = []
    for name in names:
        port = free_port()
        argv_ = [*exe, "--port", str(port), *shlex.split(name), "--no-progress"]
        log = "".join(c if c.isalnum() else "_" for c in name)
        servers.append(Server(name, argv_, port, log_dir / f"{log}.log", env=env))
    return servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [args.baseline_args, f"--max-batch {args.max_batch}"]
    servers = evospec_servers(args, names, "evospec-concurrency-")
    pool = load_prompts(args.data, args.requests * args.rounds)
    rounds = [pool[r * args.requests : (r + 1) * args.requests] for r in range(args.rounds)]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for srv in servers:
            srv.start()
        wait_healthy(servers, 900.0)
        for srv in servers:
            srv.model_id = model_id(srv)
            stream_chat(srv, "Hello!", 8, False, 120.0, prompt_index=-1, repeat=0, order=0)  # warm-up
        for rnd in range(args.rounds):
            order = servers if rnd % 2 == 0 else servers[::-1]
            for srv in order:
                load = (args.clients, args.max_tokens, args.ignore_eos, args.temperature)
                run = run_load(srv, rounds[rnd], *load)
                runs[srv.name].append(run)
                print(f"round {rnd + 1} {srv.name}: {run['throughput_tok_s']:.1f} tok/s, "
                      f"{run['failed']} failed", file=sys.stderr)  # fmt: skip
    finally:
        for srv in servers:
            srv.stop()
    table, summary = summary_table(names, runs)
    texts = [_texts(runs[n]) for n in names]
    total = args.requests * args.rounds
    same = sum(texts[0].get(key) == text for key, text in texts[1].items())
    failed = sum(r["failed"] for n in names for r in runs[n])
    print(table)
    if args.temperature > 0:
        same = total  # samples: nothing to compare
        print(f"sampled at T={args.temperature:g}: answers not compared; failed requests: {failed}")
    else:
        print(f"same text from both servers: {same}/{total} requests; failed requests: {failed}")
    if args.out:
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        out = {"config": cfg, "summary": summary, "same_text": same, "runs": runs}
        args.out.write_text(json.dumps(out, indent=1))
    return 0 if failed == 0 and same == total else 1


if __name__ == "__main__":
    sys.exit(main())

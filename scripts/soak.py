"""A bounded soak of ``evospec serve``: mixed valid and invalid traffic from several clients.

Starts ``evospec serve`` (extra arguments via ``--serve-args``), records one greedy reference
answer per prompt before the load starts, then runs ``--clients`` threads for ``--minutes``:
greedy chat requests (plain and streamed; each answer must equal its reference), seeded sampled
ones, and invalid ones (broken JSON, wrong types, unknown model, lone surrogates, a 5 MB body,
a 2000-digit integer, JSON nested 100,000 deep, ...; each must be a 4xx with the OpenAI error
shape). Every ``--sample-s`` seconds it records the server's RSS and the latency of the valid
requests of that window. It prints requests by status code, mismatches, 5xx, RSS over time and
p50/p99 latency per window (drift), and writes everything to ``--out``:

    .venv/bin/python scripts/soak.py --minutes 30 --clients 8 --serve-args "--method evospec" --out soak.json

Needs nothing but the project (prompts: ``evospec.decoding.tune.CALIBRATION_TEXTS``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

MAX_TOKENS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(
    port: int, body: bytes, path: str = "/v1/chat/completions", timeout: float = 120
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _chat(model: str, text: str, **kw) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS, **kw}


def _streamed_text(raw: bytes) -> str:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


def _invalid_bodies(model: str) -> list[tuple[str, bytes]]:
    ok = json.dumps(_chat(model, "hi"))
    return [
        ("broken json", b'{"model": '),
        ("max_tokens -1", json.dumps(_chat(model, "hi", max_tokens=-1)).encode()),
        ("max_tokens string", json.dumps({**_chat(model, "hi"), "max_tokens": "ten"}).encode()),
        ("unknown model", json.dumps(_chat("no-such-model", "hi")).encode()),
        ("no messages", json.dumps({"model": model}).encode()),
        ("lone surrogate", ok.replace('"hi"', '"\\ud800"').encode()),
        ("2000-digit int", ok.replace(f'"max_tokens": {MAX_TOKENS}', '"max_tokens": ' + "9" * 2000).encode()),
        ("deep nesting", b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("5 MB body", json.dumps(_chat(model, "x" * 5_000_000)).encode()),
        ("temperature -1", json.dumps(_chat(model, "hi", temperature=-1)).encode()),
        ("seed 2**64", json.dumps(_chat(model, "hi", seed=2**64)).encode()),
    ]


class Soak:
    """Shared counters of one run (all updated under ``lock``)."""

    def __init__(self, port: int, model: str, refs: dict[str, str]) -> None:
        self.port, self.model, self.refs = port, model, refs
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.mismatches: list[dict] = []
        self.bad_errors: list[dict] = []
        self.latencies: list[tuple[float, float]] = []  # (end time, seconds) of valid requests

    def one(self, rng: random.Random, invalid: list[tuple[str, bytes]]) -> None:
        roll = rng.random()
        text = rng.choice(list(self.refs))
        t0 = time.perf_counter()
        if roll < 0.2:  # invalid
            name, body = rng.choice(invalid)
            status, raw = _post(self.port, body)
            kind = "invalid"
            try:
                err = json.loads(raw).get("error", {})
                shaped = isinstance(err, dict) and {"message", "type"} <= set(err)
            except (json.JSONDecodeError, AttributeError):
                shaped = False
            if not (400 <= status < 500 and shaped):
                self._note(
                    self.bad_errors, {"case": name, "status": status, "body": raw[:200].decode("replace")}
                )
        elif roll < 0.35:  # sampled, seeded
            kind = "sampled"
            status, raw = _post(
                self.port,
                json.dumps(_chat(self.model, text, temperature=0.8, seed=rng.randrange(1 << 30))).encode(),
            )
        elif roll < 0.5:  # streamed greedy
            kind = "greedy-stream"
            status, raw = _post(
                self.port, json.dumps(_chat(self.model, text, temperature=0, stream=True)).encode()
            )
            if status == 200 and _streamed_text(raw) != self.refs[text]:
                self._note(self.mismatches, {"prompt": text[:40], "kind": kind})
        else:
            kind = "greedy"
            status, raw = _post(self.port, json.dumps(_chat(self.model, text, temperature=0)).encode())
            if status == 200 and json.loads(raw)["choices"][0]["message"]["content"] != self.refs[text]:
                self._note(self.mismatches, {"prompt": text[:40], "kind": kind})
        dt = time.perf_counter() - t0
        with self.lock:
            self.codes[str(status)] += 1
            self.kinds[kind] += 1
            if kind != "invalid" and status == 200:
                self.latencies.append((time.time(), dt))

    def _note(self, where: list, item: dict) -> None:
        with self.lock:
            where.append(item)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument(
        "--serve-args", default="", help='extra arguments for `evospec serve`, e.g. "--method evospec"'
    )
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds per RSS / latency window")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    from evospec.decoding.tune import CALIBRATION_TEXTS

    port = _free_port()
    exe = str(Path(sys.executable).with_name("evospec"))
    cmd = [exe, "serve", "--port", str(port), "--no-progress", *shlex.split(a.serve_args)]
    log = open(f"/tmp/evospec-soak-{port}.log", "w")  # noqa: SIM115 (lives as long as the server)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/v1/models")
                models = json.loads(conn.getresponse().read())
                model = models["data"][0]["id"]
                break
            except (OSError, KeyError, json.JSONDecodeError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"evospec serve did not start; see {log.name}") from None
                time.sleep(0.5)
        refs = {}
        for text in CALIBRATION_TEXTS:
            status, raw = _post(port, json.dumps(_chat(model, text, temperature=0)).encode())
            refs[text] = json.loads(raw)["choices"][0]["message"]["content"]
        soak = Soak(port, model, refs)
        invalid = _invalid_bodies(model)
        stop = time.monotonic() + 60 * a.minutes

        def client(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                try:
                    soak.one(rng, invalid)
                except OSError as exc:  # a connection error is a failure of the server too
                    soak._note(soak.bad_errors, {"case": "connection", "status": None, "body": repr(exc)})

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        windows = []
        t_start = time.time()
        while any(t.is_alive() for t in threads):
            time.sleep(a.sample_s)
            now = time.time()
            with soak.lock:
                lat = [d for end, d in soak.latencies if end > now - a.sample_s]
                served = sum(soak.codes.values())
            windows.append(
                {
                    "t_min": round((now - t_start) / 60, 2),
                    "rss_mb": round(_rss_mb(server.pid), 1),
                    "requests": served,
                    "p50_s": round(statistics.median(lat), 3) if lat else None,
                    "p99_s": round(sorted(lat)[int(0.99 * (len(lat) - 1))], 3) if lat else None,
                }
            )
            print(json.dumps(windows[-1]), file=sys.stderr, flush=True)
        status, _ = _post(port, json.dumps(_chat(model, "hi", temperature=0)).encode())
        result = {
            "config": vars(a) | {"out": str(a.out), "model": model},
            "codes": dict(soak.codes),
            "kinds": dict(soak.kinds),
            "mismatches": soak.mismatches,
            "bad_errors": soak.bad_errors[:50],
            "bad_error_count": len(soak.bad_errors),
            "healthy_after": status == 200,
            "windows": windows,
        }
        print(f"requests by status: {dict(sorted(soak.codes.items()))}; by kind: {dict(soak.kinds)}")
        print(f"greedy mismatches: {len(soak.mismatches)}; errors not 4xx-shaped: {len(soak.bad_errors)}")
        rss = [w["rss_mb"] for w in windows]
        if rss:
            print(f"server RSS MB: first {rss[0]}, max {max(rss)}, last {rss[-1]}")
        print("| minute | RSS MB | requests so far | p50 s | p99 s |\n|---|---|---|---|---|")
        for w in windows:
            print(f"| {w['t_min']} | {w['rss_mb']} | {w['requests']} | {w['p50_s']} | {w['p99_s']} |")
        print(f"healthy afterwards: {result['healthy_after']}")
        if a.out:
            a.out.write_text(json.dumps(result, indent=2))
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    main()

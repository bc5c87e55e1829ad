"""``evospec serve``: flags override the config file, and -- end to end in a subprocess -- the
real command serves a model folder and the curl line it prints to stderr works as pasted."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from evospec.cli import main
from service.config import ServeConfig
from service.context import ServedModel
from service.server import curl_example
from tests.indices.helpers import write_model_folder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_cmd_serve_merges_config_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServeConfig] = []
    monkeypatch.setattr("service.server.serve", lambda cfg, progress=True: seen.append(cfg))
    assert main(["serve", "--config", str(CONFIGS / "ar.yaml"), "--port", "9123", "--host", "0.0.0.0"]) == 0
    assert (seen[0].port, seen[0].host, seen[0].method, seen[0].max_queue) == (9123, "0.0.0.0", "ar", 64)
    assert main(["serve"]) == 0 and seen[1] == ServeConfig()


def test_cmd_serve_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--method", "medusa"]) == 2
    assert "method 'medusa' is not one of" in capsys.readouterr().err
    assert main(["serve", "--config", "/nonexistent.yaml"]) == 2


def test_serve_with_an_unknown_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "gpu"]) == 2  # fails before any model is loaded
    assert "unknown device 'gpu'" in capsys.readouterr().err


def test_curl_example(codec) -> None:
    served = ServedModel(name="m", codec=codec, context_window=8, vocab_size=codec.vocab_size)
    line = curl_example("0.0.0.0", 8000, served)
    assert line.startswith("curl -s http://127.0.0.1:8000/v1/chat/completions ")
    body = json.loads(line.split(" -d ", 1)[1].strip("'"))
    assert body["model"] == "m" and body["messages"][0]["role"] == "user"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess_and_printed_curl(tmp_path: Path, tiny, codec, reference) -> None:
    folder = tmp_path / "tiny-folder"
    write_model_folder(folder, tiny, codec)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "EVOSPEC_ADMIN_TOKEN": "t0k"}
    cmd = [
        sys.executable,
        "-m",
        "evospec.cli",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--no-progress",
        "--weights",
        "fp32",  # the reference decodes the fp32 weights (serve's default on a CPU is int4)
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        curl = None
        deadline = time.monotonic() + 60
        while curl is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "evospec serve exited early"
            if line.startswith("curl "):
                curl = line.strip()
        assert curl is not None
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            while time.monotonic() < deadline:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            state = http.get("/admin/state", headers={"Authorization": "Bearer t0k"})
            assert state.status_code == 200 and state.json()["model"] == "tiny-folder"
        out = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=30)
        reply = json.loads(out.stdout)
        ids = codec.encode_chat(
            [{"role": "user", "content": "Explain speculative decoding in one sentence."}]
        )
        assert reply["choices"][0]["message"]["content"] == reference(ids, 64)
        assert reply["model"] == "tiny-folder" and reply["evospec"]["method"] == "ar"
    finally:
        proc.terminate()
        proc.wait(20)
        proc.stderr.close()


def test_sigterm_stops_the_server_with_its_restart_state_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kill`, `docker stop` and systemd send SIGTERM. Uvicorn shuts down gracefully, then raises
    the signal again under the handler that was there before it: Python's default would end the
    process before ``serve`` saves the restart state; serve's handler makes it an exit that
    ``finally`` sees. A real uvicorn on a free port, signalled once it runs."""
    import io
    import signal
    import threading
    from types import SimpleNamespace

    import uvicorn
    from starlette.applications import Starlette

    from service import server

    closed: list[bool] = []
    keeper = SimpleNamespace(
        restore=lambda: "restart state: none yet",
        start=lambda: None,
        close=lambda: closed.append(True) or True,
        path="/state/snapshot",
    )
    model = SimpleNamespace(name="m")
    built = SimpleNamespace(app=Starlette(), engine=SimpleNamespace(method="ar"), model=model, keeper=keeper)
    monkeypatch.setattr(server, "build", lambda config, progress=True, log=None: built)
    monkeypatch.setattr(server, "curl_example", lambda host, port, model: "curl ...")
    real_run = uvicorn.run

    def run(app, **kw) -> None:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        real_run(app, **kw)

    monkeypatch.setattr(uvicorn, "run", run)
    old_term, old_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    log = io.StringIO()
    try:
        with pytest.raises(SystemExit) as exc:
            server.serve(ServeConfig(port=_free_port()), log=log)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    assert exc.value.code == 128 + signal.SIGTERM and closed == [True]
    assert "restart state saved to /state/snapshot" in log.getvalue()

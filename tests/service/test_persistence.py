"""Restart safety (issue 21): the ARC buffer and the online adapters survive a restart.

A snapshot round-trips (the restored ARC state, adapter versions and tensors equal what was
saved, and the serving head takes the restored weights); a snapshot for another model, draft
head, ARC config or LoRA rank is ignored with a warning; a truncated, damaged or foreign file
is ignored; a writer killed mid-write (a subprocess, SIGKILLed between its temp write and the
rename) or failing at the rename leaves the previous snapshot loadable; snapshots are taken
periodically at the engine's safe points while it serves, and once more at shutdown;
``evospec serve`` restores before serving and saves after; ``/admin/state`` reports it.

The decoders are ``evospec-full`` (ARC buffer + CL-LoRA) on the 64-id tiny target of
``tests/conftest.py``, with inline retrieval and inline updates, so the state after a few
prompts is deterministic (and both paths really learn: the 16-id static core misses tokens, and
covered positions get admitted).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import service.persistence as persistence
from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import SpeculativeDecoder, make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from service.config import ServeConfig
from service.engine import Done, Engine, GenerationRequest
from service.persistence import Identity, StateKeeper, decode_snapshot, encode_snapshot, keeper_for
from tests.decoding.spec_helpers import prompt_of, tiny_target
from tests.service.helpers import wait_for
from tests.vocab.helpers import SMALL, stand_in_indices

REPO = Path(__file__).resolve().parents[2]
TREE = TreeConfig(top_k=4, depth=3, total_tokens=8)
ADAPT = AdaptConfig(buffer_size=4, lr=1e-2, context=8, k_logit=16, rank=4, alpha=4, asynchronous=False)
PROMPTS = [prompt_of(i, 12) for i in range(3)]
EOS = (63,)
TOKEN = "persist-admin-token"


def _decoder(target, draft, vocab=SMALL, **adapt) -> SpeculativeDecoder:
    return make_decoder(
        "evospec-full",
        target,
        eos_ids=EOS,
        draft=draft,
        tree=TREE,
        vocab=vocab,
        indices=stand_in_indices(target),
        adapt=replace(ADAPT, **adapt),
    )


@pytest.fixture(scope="module")
def draft(target):
    return new_eagle_for(target, seed=3)


@pytest.fixture
def make(target, draft) -> Iterator[Callable[..., SpeculativeDecoder]]:
    """Factory of fresh evospec-full decoders (closed after the test)."""
    made: list[SpeculativeDecoder] = []

    def factory(vocab=SMALL, **adapt) -> SpeculativeDecoder:
        made.append(_decoder(target, draft, vocab, **adapt))
        return made[-1]

    yield factory
    for dec in made:
        dec.close()


@pytest.fixture(scope="module")
def identity(target, draft) -> Identity:
    return Identity.of("evospec-full", "tiny-llama", target, draft)


def _serve(dec: SpeculativeDecoder, prompts=PROMPTS) -> None:
    for p in prompts:
        list(dec.generate(p, SamplingParams(max_new_tokens=24)))


Q = "layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def trained(target, draft, identity) -> Iterator[SimpleNamespace]:
    """What one decoder learnt from a few prompts (ARC ids resident, adapter versions published),
    as state and as snapshot bytes: ``a`` after :data:`PROMPTS`, ``b`` after one more prompt."""
    dec = _decoder(target, draft)
    try:
        _serve(dec)
        out = SimpleNamespace(a=_state(dec, identity))
        st = out.a.arc
        assert len(st["t1"]) + len(st["t2"]) > 0 and st["events"] > 0 and out.a.versions[0][1] >= 1
        _serve(dec, [prompt_of(7, 12)])
        out.b = _state(dec, identity)
        assert out.b.arc != out.a.arc
        yield out
    finally:
        dec.close()


def _state(dec: SpeculativeDecoder, ident: Identity) -> SimpleNamespace:
    dec.adapt.select(None)  # the serving head takes the newest version
    learnt = dec.adapt.learnt()
    return SimpleNamespace(
        arc=dec.vocab.dynamic_state(),
        versions=[(k, v) for k, v, _ in learnt],
        tensors=[t for _, _, t in learnt],
        q=dec.drafter.head.get_parameter(Q).detach().clone(),
        data=encode_snapshot(persistence.capture(ident, dec.vocab, dec.adapt)),
    )


def _keeper(dec: SpeculativeDecoder, ident: Identity, folder: Path, interval_s: float = 0.0) -> StateKeeper:
    return StateKeeper(Engine(dec), ident, folder, interval_s=interval_s, keep_arc=True)


def _on_disk(keeper: StateKeeper, data: bytes) -> None:
    persistence.write_snapshot_file(keeper.folder, keeper.file, data)


def _assert_state(dec: SpeculativeDecoder, want: SimpleNamespace) -> None:
    assert dec.vocab.dynamic_state() == want.arc
    learnt = dec.adapt.learnt()
    assert [(k, v) for k, v, _ in learnt] == want.versions
    for (_, _, got), exp in zip(learnt, want.tensors, strict=True):
        assert set(got) == set(exp) and all(torch.equal(got[n], exp[n]) for n in exp)


def _assert_empty(dec: SpeculativeDecoder) -> None:
    st = dec.vocab.dynamic_state()
    assert st["t1"] == [] and st["t2"] == [] and st["clock"] == 0
    assert dec.adapt.learnt() == [] and dec.adapt.versions() == {}


def test_a_snapshot_round_trips_through_a_restart(trained, make, identity, tmp_path: Path) -> None:
    restarted = make()
    keeper = _keeper(restarted, identity, tmp_path)
    assert keeper.path.name == "tiny-llama.evospec-full.snapshot"
    _on_disk(keeper, trained.a.data)
    line = keeper.restore()
    assert line.startswith("restart state restored:"), line
    _assert_state(restarted, trained.a)
    status = keeper.status()
    assert status["restored"]["outcome"] == "restored" and status["keeps"] == ["arc", "adapters"]
    # the serving head takes the restored weights at the next boundary; the ARC ids are active
    restarted.adapt.select(None)
    assert torch.equal(restarted.drafter.head.get_parameter(Q), trained.a.q)
    active = restarted.vocab.policy.active_mask(0)
    assert all(bool(active[tok]) for tok, _ in trained.a.arc["t1"] + trained.a.arc["t2"])
    # the keeper's own snapshot of the restored state writes the same state back
    restarted.vocab.reset_dynamic()
    assert keeper.snapshot() and keeper.status()["snapshots"] == 1
    again = make()
    assert _keeper(again, identity, tmp_path).restore().startswith("restart state restored:")
    assert again.vocab.dynamic_state() == restarted.vocab.dynamic_state()
    assert keeper.snapshot() and keeper.status()["unchanged"] == 1  # nothing changed: no write


@pytest.mark.parametrize("what", ["model", "head", "arc_config", "lora_rank", "method"])
def test_a_mismatched_snapshot_is_ignored_with_a_warning(
    what, trained, make, identity, target, tmp_path: Path, caplog
) -> None:
    ident, dec = identity, None
    if what == "model":
        ident = replace(identity, model=persistence.fingerprint(tiny_target(5)))
    elif what == "head":
        ident = replace(identity, head=persistence.fingerprint(new_eagle_for(target, seed=11)))
    elif what == "arc_config":
        dec = make(vocab=replace(SMALL, arc_capacity=6))
    elif what == "lora_rank":
        dec = make(rank=2)
    else:
        ident = replace(identity, method="clora")
    dec = dec or make()
    keeper = _keeper(dec, ident, tmp_path)
    keeper.file = "tiny-llama.evospec-full.snapshot"  # (the method names the file)
    _on_disk(keeper, trained.a.data)
    with caplog.at_level(logging.WARNING, logger="evospec.service.persistence"):
        line = keeper.restore()
    assert "restart state mismatch:" in line and "ignored" in line, line
    assert any(r.levelno == logging.WARNING and "ignored" in r.getMessage() for r in caplog.records)
    _assert_empty(dec)
    assert not keeper.path.exists() and (tmp_path / f"{keeper.file}.rejected").is_file()  # kept aside
    assert keeper.status()["restored"]["outcome"] == "mismatch"
    assert keeper.snapshot() and keeper.path.is_file()  # the next snapshot replaces it


def _damaged(good: bytes, how: str) -> bytes:
    head = len(persistence.MAGIC) + 32
    if how == "truncated":
        return good[: len(good) // 2]
    if how == "truncated_to_header":
        return good[:head]
    if how == "payload_bit_flip":
        return good[:-10] + bytes([good[-10] ^ 0x01]) + good[-9:]
    if how == "checksum_bit_flip":
        return good[: head - 1] + bytes([good[head - 1] ^ 0x80]) + good[head:]
    if how == "empty":
        return b""
    if how == "another_file":
        return b"PK\x03\x04 certainly not a snapshot"
    if how == "newer_format":
        return b"EVOSPEC-SNAPSHOT/2\n" + good[len(persistence.MAGIC) :]
    if how == "checksummed_junk":
        return persistence.MAGIC + hashlib.sha256(b"junk").digest() + b"junk"
    raise ValueError(how)


@pytest.mark.parametrize(
    "how",
    [
        "truncated",
        "truncated_to_header",
        "payload_bit_flip",
        "checksum_bit_flip",
        "empty",
        "another_file",
        "newer_format",
        "checksummed_junk",
    ],
)
def test_a_truncated_or_corrupt_snapshot_is_ignored(
    how, trained, make, identity, tmp_path: Path, caplog
) -> None:
    dec = make()
    keeper = _keeper(dec, identity, tmp_path)
    _on_disk(keeper, _damaged(trained.a.data, how))
    with caplog.at_level(logging.WARNING, logger="evospec.service.persistence"):
        line = keeper.restore()  # never raises
    assert "restart state corrupt:" in line and "ignored" in line, line
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    _assert_empty(dec)


def test_a_format_version_in_the_metadata_is_checked(trained, monkeypatch) -> None:
    snap = decode_snapshot(trained.a.data)
    monkeypatch.setattr(persistence, "FORMAT", 2)
    data = encode_snapshot(snap)
    monkeypatch.setattr(persistence, "FORMAT", 1)
    with pytest.raises(persistence.SnapshotError, match="snapshot format 2, this server reads 1") as err:
        decode_snapshot(data)
    assert err.value.kind == "mismatch"


def test_no_snapshot_starts_empty(make, identity, tmp_path: Path) -> None:
    dec = make()
    keeper = _keeper(dec, identity, tmp_path / "never-made")
    assert keeper.restore().startswith("restart state none: no snapshot")
    _assert_empty(dec)


_KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from types import SimpleNamespace
from service import persistence

def stall(fd):  # the temp file is written; the rename has not happened
    print("mid-write", flush=True)
    time.sleep(120)

os.fsync = stall
persistence.write_snapshot_file(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).read_bytes())
"""


def test_a_writer_killed_mid_write_leaves_the_previous_snapshot(
    trained, make, identity, tmp_path: Path
) -> None:
    folder = tmp_path / "state"
    keeper = _keeper(make(), identity, folder)
    _on_disk(keeper, trained.a.data)
    newer = tmp_path / "newer.bin"
    newer.write_bytes(trained.b.data)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(folder), keeper.file, str(newer)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "mid-write", line or proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
    temps = [p for p in folder.iterdir() if p.name.startswith(".")]
    assert len(temps) == 1 and temps[0].read_bytes() == trained.b.data  # the dead writer's temp
    assert keeper.path.read_bytes() == trained.a.data
    dec = make()
    assert _keeper(dec, identity, folder).restore().startswith("restart state restored:")
    _assert_state(dec, trained.a)
    assert [p.name for p in folder.iterdir()] == [keeper.file]  # the stale temp was cleared


def test_a_failed_rename_keeps_the_previous_snapshot(
    trained, make, identity, tmp_path: Path, monkeypatch
) -> None:
    import evospec.files

    dec = make()
    keeper = _keeper(dec, identity, tmp_path)
    _on_disk(keeper, trained.a.data)
    assert keeper.restore().startswith("restart state restored:")
    dec.vocab.reset_dynamic()  # a change to write

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evospec.files.os, "replace", crash)
    assert keeper.snapshot() is False
    st = keeper.status()
    assert st["failures"] == 1 and "No space left on device" in st["last_error"]["error"]
    assert keeper.path.read_bytes() == trained.a.data and [p.name for p in tmp_path.iterdir()] == [
        keeper.file
    ]
    monkeypatch.undo()
    assert keeper.snapshot() and keeper.path.read_bytes() != trained.a.data


def test_periodic_snapshots_run_at_safe_points_while_serving(make, identity, tmp_path: Path) -> None:
    dec = make()
    engine = Engine(dec)
    keeper = StateKeeper(engine, identity, tmp_path, interval_s=0.02, keep_arc=True)
    engine.start()
    keeper.start()
    try:
        done: list[Done] = []
        for p in PROMPTS:
            req = GenerationRequest(p, SamplingParams(max_new_tokens=24), timeout_s=120)
            engine.submit(req, lambda item: done.append(item) if isinstance(item, Done) else None)
        assert wait_for(lambda: len(done) == len(PROMPTS), 120)
        assert all(d.outcome == "finished" for d in done)
        assert wait_for(lambda: keeper.status()["snapshots"] >= 2, 30)
    finally:
        engine.stop()
        assert keeper.close()
    assert keeper.status()["failures"] == 0
    snap = decode_snapshot(keeper.path.read_bytes())
    assert snap.identity == identity and snap.arc == dec.vocab.dynamic_state()
    assert [(a.key, a.version) for a in snap.adapters] == [(k, v) for k, v, _ in dec.adapt.learnt()]


def test_keeper_for_follows_the_config(make, target, draft, tmp_path: Path) -> None:
    engine = Engine(make())
    cfg = ServeConfig(method="evospec-full", state_dir=str(tmp_path))
    keeper = keeper_for(cfg, engine, "tiny-llama", target, draft)
    assert keeper is not None and keeper.vocab is engine.vocab and keeper.adapter is engine.adapter
    assert keeper.folder == tmp_path and keeper.interval_s == 600.0
    no_arc = keeper_for(replace(cfg, vocab=replace(cfg.vocab, persist=False)), engine, "m", target, draft)
    assert no_arc is not None and no_arc.vocab is None and no_arc.status()["keeps"] == ["adapters"]
    assert keeper_for(replace(cfg, persist_state=False), engine, "m", target, draft) is None
    ar = Engine(make_decoder("ar", target))
    assert keeper_for(replace(cfg, method="ar"), ar, "m", target, None) is None


def test_serve_restores_before_serving_and_saves_after(
    make, codec, identity, tmp_path: Path, monkeypatch
) -> None:
    """Two runs of ``evospec serve`` (uvicorn stubbed): the second starts where the first ended."""
    import uvicorn

    import service.server as server
    from service.app import create_app
    from service.context import ServedModel

    seen: list[dict] = []

    def fake_build(config, **kwargs):
        dec = make()
        engine = Engine(dec)
        model = ServedModel("tiny-llama", codec, 256, dec.model.cfg.vocab_size)
        keeper = StateKeeper(engine, identity, tmp_path, interval_s=0, keep_arc=True)
        app = create_app(engine, model, config)
        persistence.attach(app, keeper)
        return server.Built(app, engine, model, keeper)

    def fake_run(app, **kwargs):  # the engine thread is not started: serve on this thread
        dec = app.state.ctx.engine.decoder
        seen.append(dec.vocab.dynamic_state())
        _serve(dec, PROMPTS[len(seen) - 1 : len(seen)])
        seen.append(dec.vocab.dynamic_state())

    monkeypatch.setattr(server, "build", fake_build)
    monkeypatch.setattr(uvicorn, "run", fake_run)
    log = tmp_path / "log.txt"
    for _ in range(2):
        with log.open("a") as out:
            server.serve(ServeConfig(method="evospec-full"), progress=False, log=out)
    assert seen[0]["clock"] == 0 and seen[1]["clock"] > 0
    assert seen[2] == seen[1]  # restored exactly what the first run ended with
    text = log.read_text()
    assert "[evospec] restart state none" in text and "[evospec] restart state restored" in text
    assert text.count("[evospec] restart state saved to") == 2


def test_admin_state_reports_persistence(serve, make, identity, tmp_path: Path) -> None:
    live = serve(make(), admin_token=TOKEN)
    keeper = StateKeeper(live.engine, identity, tmp_path, interval_s=0, keep_arc=True)
    with live.http(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        off = http.get("/admin/state").json()["persistence"]
        assert off["enabled"] is False and "no restart snapshots" in off["note"]
        persistence.attach(live.server.config.app, keeper)  # what server.build does
        keeper.restore()
        assert keeper.snapshot()
        st = http.get("/admin/state").json()["persistence"]
    assert st["enabled"] is True and st["note"] is None and st["file"] == str(keeper.path)
    assert st["restored"]["outcome"] == "none" and st["snapshots"] == 1 and st["failures"] == 0
    assert st["last_snapshot"]["bytes"] == keeper.path.stat().st_size and st["interval_minutes"] is None


def test_fingerprint_of_a_parameter_larger_than_float32_counts_exactly():
    """Evenly spaced sample indices stay in range past 2^24 elements (a float32 linspace of
    SmolLM2's 28,311,552-entry embedding rounded its last index out of bounds)."""
    import torch

    from service.persistence import fingerprint

    module = torch.nn.Module()
    module.big = torch.nn.Parameter(torch.zeros(2**24 + 2, dtype=torch.int8), requires_grad=False)
    first = fingerprint(module)
    with torch.no_grad():
        module.big[-1] = 1  # the last element is always sampled
    assert fingerprint(module) != first

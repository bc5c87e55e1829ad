"""The active-vocabulary methods through the server: frspec, nanospec, evospec and
nanospec+evospec answer exactly what plain greedy decoding answers; responses, ``/admin/vocab``,
``/admin/state`` and ``/metrics`` report coverage, active size, the ARC buffer and OOV events;
a vocabulary reset runs on the engine thread at a safe point (between two rounds, or while
idle), never while a round is in flight; ``server.build`` loads the indices a method needs.

The tiny target speaks the real tokenizer (49,152 ids); the "indices" are stand-ins: a
frequency table that ranks id 0 first (so the static core is ids 0..15 and most generated
tokens start out OOV), exact inner-product search for the HNSW index, and an arithmetic
successor graph.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import service.admin as admin
from evospec.decoding.events import StepEvent
from evospec.decoding.methods import SpeculativeDecoder, make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.vocab.config import VocabConfig
from service.config import ServeConfig
from service.engine import Done, Engine, GenerationRequest
from tests.service.helpers import (
    MODEL_NAME,
    GateDecoder,
    WrappedDecoder,
    api_error,
    ar_ids,
    complete,
    metric_value,
    wait_for,
)
from tests.vocab.helpers import SMALL, stand_in_indices

TREE = TreeConfig(top_k=4, depth=3, total_tokens=8)
TOKEN = "vocab-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
VOCAB_METHODS = ("frspec", "nanospec", "evospec", "nanospec+evospec")


@pytest.fixture(scope="module")
def bundle(tiny) -> SimpleNamespace:
    return stand_in_indices(tiny)


@pytest.fixture
def make(tiny, codec, head, bundle) -> Callable[[str], SpeculativeDecoder]:
    def factory(name: str) -> SpeculativeDecoder:
        dec = make_decoder(
            name, tiny, eos_ids=codec.eos_ids, draft=head, tree=TREE, vocab=SMALL, indices=bundle
        )
        assert isinstance(dec, SpeculativeDecoder)
        return dec

    return factory


# -- lossless through the API -----------------------------------------------------------------------
@pytest.mark.parametrize("name", VOCAB_METHODS)
def test_vocab_methods_equal_greedy(name: str, serve, make, codec, reference) -> None:
    live = serve(make(name))
    client = live.openai()
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == reference(codec.encode(prompt), 20)
        spec = r.model_extra["evospec"]
        assert spec["method"] == name and spec["rounds"] >= 1
        assert 0.0 <= spec["coverage"] <= 1.0 and spec["active_vocab_size"] > 0
        assert isinstance(spec["oov_events"], int) and 0 <= spec["oov_events"] <= spec["rounds"]
    messages = [{"role": "user", "content": "Tell me a story."}]
    expected = reference(codec.encode_chat(messages), 16)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_frspec_drafts_from_the_table_only(serve, make, codec) -> None:
    live = serve(make("frspec"))
    spec = complete(live, PROMPTS[0])["evospec"]
    assert spec["active_vocab_size"] == len(set(range(16)) | set(codec.eos_ids))  # table + EOS ids


# -- admin: state, reset ----------------------------------------------------------------------------
def test_evospec_admin_state_shows_the_arc_buffer(serve, make) -> None:
    live = serve(make("evospec"), admin_token=TOKEN)
    oov = sum(complete(live, p)["evospec"]["oov_events"] for p in PROMPTS)
    assert oov > 0  # the static core is ids 0..15: generated tokens start out OOV
    assert wait_for(lambda: live.engine.snapshot().outcomes["finished"] == 2)
    with live.http(headers=AUTH) as http:
        vocab = http.get("/admin/vocab").json()
        with_ids = http.get("/admin/vocab?ids=true").json()
        state = http.get("/admin/state").json()
        api_error(http.get("/admin/vocab?ids=maybe"), 400, "invalid_value")
    assert vocab["method"] == "evospec" and vocab["policy"] == "evospec"
    assert vocab["static_size"] == 16 and vocab["window"] is None
    assert vocab["pending_retrievals"] in (0, 1)  # the last event's result waits for a next round
    arc = vocab["arc"]
    assert (arc["capacity"], arc["ghost_capacity"], arc["persist"]) == (8, 8, True)
    assert 0 < arc["size"] == arc["t1"] + arc["t2"] <= 8 and arc["b1"] <= 8 and arc["b2"] <= 8
    assert 0.0 <= arc["p"] <= 8.0 and arc["events"] > 0 and arc["clock"] > 0
    assert "ids" not in arc
    ids = with_ids["arc"]["ids"]
    assert [len(ids[k]) for k in ("t1", "t2", "b1", "b2")] == [arc[k] for k in ("t1", "t2", "b1", "b2")]
    assert all(tok >= 16 for tok in ids["t1"] + ids["t2"])  # the core is never admitted twice

    voc, arc_s, oov_s = state["vocabulary"], state["arc"], state["oov"]
    assert voc["implemented"] and voc["note"] is None and voc["policy"] == "evospec"
    assert voc["coverage"] == pytest.approx(voc["covered_tokens"] / voc["verified_tokens"])
    assert voc["static_size"] == 16 and voc["mean_active_vocab_size"] >= 16
    assert arc_s["implemented"] and arc_s["note"] is None
    assert {k: arc_s[k] for k in ("t1", "t2", "b1", "b2", "p", "size")} == {
        k: arc[k] for k in ("t1", "t2", "b1", "b2", "p", "size")
    }
    assert oov_s["implemented"] and oov_s["events_total"] == oov
    # a result still unmerged when its request ends is dropped (retrievals never cross requests)
    assert oov - len(PROMPTS) <= oov_s["retrievals"] <= oov
    assert oov_s["retrieval_errors"] == oov_s["retrievals_dropped"] == 0
    recent = oov_s["recent_events"]
    assert 0 < len(recent) <= oov and all(e["round"] >= 1 and isinstance(e["token"], int) for e in recent)
    assert state["adaptation"]["mode"] is None  # evospec alone does not adapt its draft (evospec-full does)


def test_vocab_reset_empties_the_arc_buffer(serve, make, codec, reference) -> None:
    live = serve(make("evospec"), admin_token=TOKEN)
    complete(live, PROMPTS[0])
    with live.http(headers=AUTH) as http:
        snapshot = http.get("/admin/vocab").json()
        before = snapshot["arc"]
        assert before["size"] > 0
        r = http.post("/admin/vocab/reset")
        assert r.status_code == 200, r.text
        body = r.json()
        after = http.get("/admin/vocab").json()["arc"]
    assert body["reset"] is True and body["method"] == "evospec"
    assert body["cleared"] == {
        "arc_size": before["size"],
        "ghosts": before["b1"] + before["b2"],
        "pending_retrievals": snapshot["pending_retrievals"],
    }
    for arc in (body["vocabulary"]["arc"], after):
        assert (arc["size"], arc["t1"], arc["t2"], arc["b1"], arc["b2"]) == (0, 0, 0, 0, 0)
        assert (arc["p"], arc["events"], arc["clock"]) == (4.0, 0, 0)  # p back to arc_p_init
    assert complete(live, PROMPTS[1])["choices"][0]["text"] == reference(codec.encode(PROMPTS[1]), 20)


@pytest.mark.parametrize("name", ["nanospec", "frspec"])
def test_reset_needs_an_arc_buffer(name: str, serve, make) -> None:
    live = serve(make(name), admin_token=TOKEN)
    with live.http(headers=AUTH) as http:
        err = api_error(http.post("/admin/vocab/reset", json={}), 409, "no_dynamic_vocabulary")
        assert f"method {name} keeps no dynamic vocabulary" in err["message"]
        vocab = http.get("/admin/vocab").json()
        state = http.get("/admin/state").json()
    assert vocab["policy"] == name and vocab["arc"] is None and vocab["pending_retrievals"] is None
    if name == "nanospec":
        assert vocab["window"] == 24 and vocab["static_size"] is None
    assert (
        state["arc"]["note"]
        == f"method {name} keeps no ARC buffer (only evospec, nanospec+evospec, evospec-full, evospec-e3, "
        "nanospec+evospec-e3, evospec-full-e3 do)"
    )
    assert state["arc"]["t1"] is None and state["vocabulary"]["policy"] == name


def test_eagle2_vocab_is_the_full_vocabulary(serve, tiny, codec, head) -> None:
    live = serve(
        make_decoder("eagle2", tiny, eos_ids=codec.eos_ids, draft=head, tree=TREE), admin_token=TOKEN
    )
    spec = complete(live, PROMPTS[0])["evospec"]
    assert spec["coverage"] == 1.0 and spec["oov_events"] == 0
    assert spec["active_vocab_size"] == tiny.cfg.vocab_size
    with live.http(headers=AUTH) as http:
        vocab = http.get("/admin/vocab").json()
        api_error(http.post("/admin/vocab/reset"), 409, "no_dynamic_vocabulary")
    assert vocab["policy"] == "full" and vocab["active_size"] == vocab["capacity"] == tiny.cfg.vocab_size


# -- the reset is serialised with generation --------------------------------------------------------
class _Paused(WrappedDecoder):
    """Logs each event and holds the round that produces event ``pause_at`` until ``go`` is set."""

    def __init__(self, inner, log: list, pause_at: int) -> None:
        super().__init__(inner)
        self.log, self.pause_at = log, pause_at
        self.reached, self.go = threading.Event(), threading.Event()

    def on_event(self, index: int, prompt: Sequence[int]) -> None:
        self.log.append(("event", index))
        if index == self.pause_at:
            self.reached.set()
            self.go.wait(30)


def test_control_calls_run_between_rounds_on_the_engine_thread(make, codec) -> None:
    inner = make("evospec")
    log: list = []
    dec = _Paused(inner, log, pause_at=2)
    engine = Engine(dec)  # the wrapper exposes the inner decoder's vocabulary
    assert engine.call(lambda: threading.current_thread().name).result() == threading.current_thread().name

    def control() -> dict:
        log.append(("control", threading.current_thread().name))
        return admin.reset_dynamic(inner.vocab)

    items: list = []
    engine.start()
    try:
        req = GenerationRequest(codec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=24), timeout_s=60)
        engine.submit(req, items.append)
        assert dec.reached.wait(10)
        fut = engine.call(control)
        time.sleep(0.2)
        assert not fut.done()  # the engine is inside a round: no safe point yet
        dec.go.set()
        assert fut.result(10)["reset"] is True
        assert wait_for(lambda: bool(items) and isinstance(items[-1], Done))
    finally:
        engine.stop()
    at = log.index(("control", "evospec-engine"))
    assert log[at - 1] == ("event", 2) and log[at + 1] == ("event", 3)  # between two rounds
    tokens = [t for ev in items if isinstance(ev, StepEvent) for t in ev.tokens]
    assert tokens == ar_ids(inner.model, codec, codec.encode(PROMPTS[0]), 24)


def test_reset_over_http_waits_for_a_safe_point(serve, make, codec, reference, monkeypatch) -> None:
    inner = make("evospec")
    gated = GateDecoder(inner)
    live = serve(gated, admin_token=TOKEN)
    done: dict = {}
    calls: list[int] = []
    real_reset = admin.reset_dynamic
    monkeypatch.setattr(admin, "reset_dynamic", lambda v: calls.append(1) or real_reset(v))

    def run_completion() -> None:
        done["completion"] = complete(live, PROMPTS[0])

    def reset() -> None:
        with live.http(headers=AUTH) as http:
            done["reset"] = http.post("/admin/vocab/reset")

    worker = threading.Thread(target=run_completion)
    worker.start()
    assert wait_for(lambda: live.engine.snapshot().active)
    # no safe point comes in time: 503, and the cancelled reset never runs later
    monkeypatch.setattr(admin, "CONTROL_TIMEOUT_S", 0.3)
    with live.http(headers=AUTH) as http:
        api_error(http.post("/admin/vocab/reset"), 503, "engine_busy")
    monkeypatch.setattr(admin, "CONTROL_TIMEOUT_S", 10.0)
    resetter = threading.Thread(target=reset)
    resetter.start()
    time.sleep(0.3)
    assert "reset" not in done and calls == []  # the engine is held inside the prefill
    gated.gate.set()
    worker.join(30)
    resetter.join(30)
    assert done["reset"].status_code == 200 and calls == [1]
    text = done["completion"]["choices"][0]["text"]
    assert text == reference(codec.encode(PROMPTS[0]), 20)


# -- metrics ----------------------------------------------------------------------------------------
def test_vocab_metrics_after_a_request(serve, make) -> None:
    live = serve(make("evospec"))
    spec = complete(live, PROMPTS[0])["evospec"]
    assert wait_for(lambda: live.engine.snapshot().outcomes["finished"] == 1)
    v = live.engine.snapshot().stats.vocab
    with live.http() as http:
        text = http.get("/metrics").text
    assert metric_value(text, "evospec_draft_verified_tokens_total") == v.verified > 0
    assert metric_value(text, "evospec_draft_covered_tokens_total") == v.covered
    assert metric_value(text, "evospec_draft_coverage") == pytest.approx(v.covered / v.verified)
    assert metric_value(text, "evospec_oov_events_total") == spec["oov_events"] > 0
    assert metric_value(text, "evospec_active_vocab_size_count") == spec["rounds"]
    assert metric_value(text, "evospec_active_vocab_size_sum") == v.active_size_sum
    assert metric_value(text, "evospec_retrievals_total") == v.retrievals > 0
    assert metric_value(text, "evospec_retrieval_latency_seconds_count") == v.retrievals
    for name in (
        "evospec_retrievals_late_total",
        "evospec_retrieval_errors_total",
        "evospec_retrievals_dropped_total",
    ):
        assert metric_value(text, name) == 0  # synchronous retrieval: never late, never saturated


# -- server.build -----------------------------------------------------------------------------------
def test_build_loads_the_indices_the_method_needs(tmp_path: Path, tiny, codec, head, monkeypatch) -> None:
    from evospec.models.eagle import save_eagle
    from indices.build import build_indices
    from indices.hnsw import HnswParams
    from service.server import build
    from tests.indices.helpers import write_model_folder

    folder = write_model_folder(tmp_path / "tiny-folder", tiny, codec)
    draft = save_eagle(head, tmp_path / "head", dtype=torch.float32)
    docs = [np.asarray(codec.encode(p), dtype=np.int64) for p in PROMPTS * 3]
    build_indices(
        tiny.lm_head.weight,
        docs,
        tmp_path / "indices",
        model_name="tiny-folder",
        hnsw_params=HnswParams(m=8, ef_construction=20),
        hnsw_threads=1,
        progress=False,
    )
    settings = VocabConfig(frspec_k=16, arc_capacity=8, arc_p_init=4, indices=str(tmp_path / "indices"))
    cfg = ServeConfig(
        model=str(folder), method="evospec", draft=str(draft), tree=TreeConfig(4, 3, 8), vocab=settings
    )
    out = StringIO()
    built = build(cfg, progress=False, log=out)
    lines = out.getvalue()
    assert f"[evospec] indices: {tmp_path / 'indices'}: frequency table" in lines and "HNSW" in lines
    assert "[evospec] draft vocabulary: policy=evospec" in lines and "arc_capacity=8" in lines
    vocab = built.engine.vocab
    assert vocab is not None and vocab.policy.name == "evospec" and vocab.policy.dyn.persist is True
    ids = codec.encode(PROMPTS[0])
    got = [
        t for ev in built.engine.decoder.generate(ids, SamplingParams(max_new_tokens=12)) for t in ev.tokens
    ]
    assert got == ar_ids(built.engine.decoder.model, codec, ids, 12)  # plain decoding, the same weights
    vocab.close()

    import indices.default

    def no_indices(*args, **kwargs):
        raise AssertionError("nanospec reads no indices")

    monkeypatch.setattr(indices.default, "ensure_indices", no_indices)
    out = StringIO()
    built = build(
        # tune_tree false: no idle timing of tree shapes beside the test
        ServeConfig(model=str(folder), method="nanospec", draft=str(draft), tune_tree=False),
        progress=False,
        log=out,
    )
    assert "indices:" not in out.getvalue() and built.engine.vocab.policy.name == "nanospec"

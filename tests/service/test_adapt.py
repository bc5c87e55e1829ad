"""Online adaptation through the server: clora, osd and evospec-full (on EAGLE-2 and EAGLE-3
heads) answer exactly what greedy
decoding answers while their adapters learn; ``/admin/adapter`` reports and steers the adapter
(save / load / reset / pause) on the engine thread; the OpenAI ``user`` field scopes adapters
when ``adapt.scope`` is ``user``; ``/metrics`` counts updates."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import METHOD_SPECS, SpeculativeDecoder, make_decoder, method_spec
from evospec.decoding.tree import TreeConfig
from tests.service.helpers import api_error, complete, wait_for
from tests.vocab.helpers import SMALL, stand_in_indices

TREE = TreeConfig(top_k=4, depth=3, total_tokens=8)
TOKEN = "adapt-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = AdaptConfig(buffer_size=4, lr=1e-2, context=8, k_logit=16, rank=4, alpha=4)
VOCAB = replace(SMALL, frspec_k=49152)  # the static core covers what the tiny model says: steps get admitted
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture
def make(tiny, codec, head) -> Callable[..., SpeculativeDecoder]:
    def factory(name: str, **cfg) -> SpeculativeDecoder:
        from evospec.models.eagle3 import new_eagle3_for

        adapt = AdaptConfig(**{**FAST.__dict__, **cfg})
        draft = new_eagle3_for(tiny, seed=2) if method_spec(name).head == "eagle3" else head
        return make_decoder(
            name,
            tiny,
            eos_ids=codec.eos_ids,
            draft=draft,
            tree=TREE,
            vocab=VOCAB,
            indices=stand_in_indices(tiny),
            adapt=adapt,
        )

    return factory


@pytest.mark.parametrize("name", [s.name for s in METHOD_SPECS.values() if s.adapt])
def test_adaptive_methods_equal_greedy_while_learning(name, serve, make, codec, reference) -> None:
    live = serve(make(name), admin_token=TOKEN)
    for prompt in PROMPTS * 2:
        assert complete(live, prompt)["choices"][0]["text"] == reference(codec.encode(prompt), 20)
    adapter = live.engine.adapter
    assert adapter is not None and adapter.wait_idle()
    assert adapter.stats.updates >= 1 and adapter.stats.errors == 0
    with live.http(headers=AUTH) as http:
        st = http.get("/admin/adapter").json()
        state = http.get("/admin/state").json()["adaptation"]
        metrics = http.get("/metrics").text
    assert st["method"] == name and st["mode"] == method_spec(name).adapt and st["updates"] >= 1
    assert st["aux_bytes"]["total"] > 0 and st["keys"]["default"]["version"] == st["updates"]
    assert state["implemented"] and state["mode"] == method_spec(name).adapt and state["update_count"] >= 1
    assert state["note"] is None and state["keys"] >= 1  # the documented fields, whichever the method
    value = re.search(r"^evospec_lora_updates_total (\S+)$", metrics, re.M)
    assert value and float(value.group(1)) == st["updates"]


def test_save_reset_load_through_admin(serve, make, codec, reference, tmp_path: Path) -> None:
    live = serve(make("clora"), admin_token=TOKEN, adapter_dir=str(tmp_path))
    for prompt in PROMPTS:
        complete(live, prompt)
    assert live.engine.adapter.wait_idle()
    served = live.engine.decoder.drafter.head
    with live.http(headers=AUTH) as http:
        saved = http.post("/admin/adapter/save", json={"name": "a"}).json()
        assert Path(saved["path"]) == tmp_path / "a.safetensors" and Path(saved["path"]).is_file()
        version = http.get("/admin/adapter").json()["keys"]["default"]["version"]
        assert version >= 1
        reset = http.post("/admin/adapter/reset").json()
        assert reset["reset_keys"] == 1
        assert http.get("/admin/adapter").json()["keys"] == {}
        loaded = http.post("/admin/adapter/load", json={"name": "a"}).json()
        assert loaded["version"] == 1 and loaded["key"] == "default" and loaded["name"] == "a"
        api_error(http.post("/admin/adapter/load", json={"name": "nope"}), 404, "adapter_not_found")
        (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
        api_error(http.post("/admin/adapter/load", json={"name": "junk"}), 400, "invalid_adapter")
        api_error(http.post("/admin/adapter/reset", json={"all": "yes"}), 400, "invalid_type")
    assert served is live.engine.decoder.drafter.head
    # still lossless after all that
    assert complete(live, PROMPTS[0])["choices"][0]["text"] == reference(codec.encode(PROMPTS[0]), 20)


def test_pausing_adaptation_stops_recording(serve, make) -> None:
    live = serve(make("clora"), admin_token=TOKEN)
    with live.http(headers=AUTH) as http:
        assert http.post("/admin/adaptation", json={"enabled": False}).json()["enabled"] is False
        complete(live, PROMPTS[0])
        assert live.engine.adapter.stats.trajectories == 0
        assert http.post("/admin/adaptation", json={"enabled": True}).json()["enabled"] is True
    complete(live, PROMPTS[0])
    assert live.engine.adapter.stats.trajectories > 0


def test_user_scope_keeps_an_adapter_per_user(serve, make) -> None:
    live = serve(make("clora", max_keys=2), admin_token=TOKEN, adapt=AdaptConfig(scope="user"))
    for user in ("alice", "bob"):
        for prompt in PROMPTS:
            complete(live, prompt, user=user)
    assert live.engine.adapter.wait_idle()
    assert wait_for(lambda: set(live.engine.adapter.versions()) == {"alice", "bob"})
    with live.http(headers=AUTH) as http:
        keys = http.get("/admin/adapter").json()["keys"]
        assert set(keys) == {"alice", "bob"}
        assert http.post("/admin/adapter/reset", json={"key": "alice"}).json()["reset_keys"] == 1
        assert set(http.get("/admin/adapter").json()["keys"]) == {"bob"}

"""Admin API: bearer-token auth (401 without or with a wrong token, 404 when no token is
configured), the state document's shape under ``ar`` (no draft vocabulary and no adapter: null
fields with a note), 409 for the vocabulary and adapter routes under ``ar`` (after body
validation). Vocabulary state under the drafting methods: ``test_vocab.py``; the adapter under
the adaptive methods: ``test_adapt.py``."""

from __future__ import annotations

import pytest

from tests.service.helpers import LiveServer, wait_for

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADAPTER_POSTS = [
    ("/admin/adapter/reset", None),
    ("/admin/adapter/save", {"name": "adapter"}),
    ("/admin/adapter/load", {"name": "adapter"}),
    ("/admin/adaptation", {"enabled": True}),
]
POSTS = [*ADAPTER_POSTS, ("/admin/vocab/reset", {})]


@pytest.fixture
def admin_server(serve) -> LiveServer:
    return serve(admin_token=TOKEN)


def _err(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}],
    ids=["missing", "wrong", "no_scheme", "basic"],
)
def test_admin_needs_the_token(admin_server: LiveServer, headers: dict) -> None:
    with admin_server.http(headers=headers) as http:
        r = http.get("/admin/state")
        _err(r, 401, "invalid_api_key")
        assert r.headers["WWW-Authenticate"] == "Bearer"
        _err(http.get("/admin/vocab?ids=maybe"), 401, "invalid_api_key")  # before the query
        for path, body in POSTS:  # auth is checked before the body
            _err(http.post(path, json=body), 401, "invalid_api_key")


def test_admin_state_shape(admin_server: LiveServer) -> None:
    with admin_server.http(headers=AUTH) as http:
        http.post(
            "/v1/completions", json={"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "temperature": 0}
        )
        # the response can leave before the engine has booked the request's end
        assert wait_for(lambda: admin_server.engine.snapshot().outcomes["finished"] == 1)
        state = http.get("/admin/state").json()
    assert state["method"] == "ar" and state["model"] == "tiny-llama"
    eng = state["engine"]
    assert eng["alive"] and eng["outcomes"]["finished"] == 1 and eng["generated_tokens"] == 3
    assert eng["mal"] == 1.0
    for section in ("vocabulary", "arc", "oov"):  # ar does not draft: measured, but nothing to show
        sec = state[section]
        assert sec["implemented"] is True and sec["note"] == "method ar has no draft vocabulary"
        assert all(v is None for k, v in sec.items() if k not in ("implemented", "note")), sec
    assert {"t1", "t2", "b1", "b2", "p", "capacity", "pending_retrievals"} <= set(state["arc"])
    assert {"policy", "active_vocab_size", "coverage"} <= set(state["vocabulary"])
    assert {"events_total", "recent_events", "retrievals_dropped"} <= set(state["oov"])
    adapt = state["adaptation"]
    assert adapt["implemented"] is True and adapt["note"] == "method ar does not adapt its draft online"
    assert {"adapter_version", "keys", "update_count", "last_loss", "replay_fill"} <= set(adapt)
    assert adapt["update_count"] is None and adapt["enabled"] is False


def test_admin_vocab_routes_refuse_ar(admin_server: LiveServer) -> None:
    with admin_server.http(headers=AUTH) as http:
        err = _err(http.get("/admin/vocab"), 409, "no_draft_vocabulary")
        assert "method ar has no draft vocabulary" in err["message"]
        _err(http.post("/admin/vocab/reset"), 409, "no_draft_vocabulary")
        _err(http.post("/admin/vocab/reset", json={"surprise": 1}), 400, "invalid_value")  # body first


def test_admin_adapter_controls_refuse_ar_after_validation(admin_server: LiveServer) -> None:
    with admin_server.http(headers=AUTH) as http:
        for path, body in ADAPTER_POSTS:
            err = _err(http.post(path, json=body), 409, "no_adapter")
            assert "method ar does not adapt its draft online" in err["message"]
        _err(http.get("/admin/adapter"), 409, "no_adapter")
        assert http.post("/admin/adapter/reset").status_code == 409  # an empty body is fine
        _err(http.post("/admin/adaptation", json={"enabled": "yes"}), 400, "invalid_type")
        _err(http.post("/admin/adaptation", json={}), 400, "missing")
        _err(http.post("/admin/adaptation", content=b"{not json"), 400, "invalid_json")
        _err(http.post("/admin/adapter/load", json={}), 400, "missing")
        _err(http.post("/admin/adapter/save", json={"path": 3}), 400, "invalid_type")


def test_admin_disabled_without_token(ar_server: LiveServer) -> None:
    with ar_server.http(headers=AUTH) as http:
        _err(http.get("/admin/state"), 404, "admin_disabled")
        _err(http.post("/admin/adaptation", json={"enabled": True}), 404, "admin_disabled")
        _err(http.get("/admin/vocab"), 404, "admin_disabled")

"""ServeConfig: the shipped presets load; bad files, keys, types and values are refused with
messages naming the file and the key; command-line overrides win."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import ConfigError, ServeConfig, TreeSettings, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.method in ("ar", "eagle2")


def test_eagle2_preset() -> None:
    cfg = load_config(CONFIGS / "eagle2.yaml")
    assert cfg.method == "eagle2" and cfg.draft is None  # the model's shipped head
    assert cfg.tree == TreeSettings(top_k=4, depth=4, total_tokens=16)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "serve.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("modle: x\n", "unknown key(s) ['modle']"),
        ("port: '8000'\n", "port must be int"),
        ("port: true\n", "port must be int"),
        ("port: 70000\n", "port 70000 is outside"),
        ("method: medusa\n", "method 'medusa' is not one of"),
        ("max_queue: 0\n", "max_queue must be >= 1"),
        ("request_timeout: 0\n", "request_timeout must be > 0"),
        ("max_tokens_limit: -1\n", "max_tokens_limit must be >= 1"),
        ("dtype: float8\n", "dtype 'float8'"),
        ("tree: {top_k: 0}\n", "tree.top_k must be an integer >= 1"),
        ("tree: {width: 3}\n", "unknown tree key(s) ['width']"),
        ("tree: 5\n", "tree must be a mapping"),
        ("- a\n- b\n", "expected a mapping"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_bad_config_is_refused(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/serve.yaml")


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "")) == ServeConfig()


def test_overrides_win_and_are_checked(tmp_path: Path) -> None:
    base = load_config(_write(tmp_path, "port: 9000\nhost: 0.0.0.0\n"))
    cfg = base.with_overrides(port=9100, host=None, model="some/folder")
    assert (cfg.port, cfg.host, cfg.model) == (9100, "0.0.0.0", "some/folder")
    with pytest.raises(ConfigError, match="is not one of"):
        base.with_overrides(method="medusa")
    with pytest.raises(ConfigError, match="port must be int"):
        base.with_overrides(port="80")

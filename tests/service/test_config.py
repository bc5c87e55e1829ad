"""ServeConfig: the shipped presets load; bad files, keys, types and values (the ``tree`` and
``vocab`` sections included) are refused with messages naming the file and the key; the vocab
section mirrors the engine's VocabConfig; command-line overrides win."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from evospec.adapt.config import AdaptConfig
from evospec.decoding.methods import METHODS
from evospec.decoding.tree_config import TreeConfig
from evospec.vocab.config import VocabConfig
from service.config import ConfigError, ServeConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESET_METHODS = {
    "ar.yaml": "ar",
    "eagle2.yaml": "eagle2",
    "eagle2-gpu.yaml": "eagle2",
    "frspec.yaml": "frspec",
    "nanospec.yaml": "nanospec",
    "evospec.yaml": "evospec",
    "nanospec-evospec.yaml": "nanospec+evospec",
    "clora.yaml": "clora",
    "osd.yaml": "osd",
    "evospec-full.yaml": "evospec-full",
    "eagle3.yaml": "eagle3",
    "frspec-e3.yaml": "frspec-e3",
    "nanospec-e3.yaml": "nanospec-e3",
    "evospec-e3.yaml": "evospec-e3",
    "nanospec-evospec-e3.yaml": "nanospec+evospec-e3",
    "vocabtrim.yaml": "vocabtrim",
    "vocabtrim-e3.yaml": "vocabtrim-e3",
    "dynaspec.yaml": "dynaspec",
    "dynaspec-e3.yaml": "dynaspec-e3",
    "specvocab.yaml": "specvocab",
    "specvocab-e3.yaml": "specvocab-e3",
    "ngram.yaml": "ngram",
    "clora-e3.yaml": "clora-e3",
    "osd-e3.yaml": "osd-e3",
    "evospec-full-e3.yaml": "evospec-full-e3",
}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.method == PRESET_METHODS[path.name]
    assert cfg.vocab == VocabConfig()  # presets spell out the papers' defaults
    assert cfg.adapt == AdaptConfig()


def test_every_method_has_a_preset() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(PRESET_METHODS)
    assert set(PRESET_METHODS.values()) == set(METHODS)


@pytest.mark.parametrize(
    "name",
    [
        "eagle2.yaml",
        "frspec.yaml",
        "nanospec.yaml",
        "evospec.yaml",
        "nanospec-evospec.yaml",
        "clora.yaml",
        "osd.yaml",
        "evospec-full.yaml",
        "eagle3.yaml",
        "frspec-e3.yaml",
        "nanospec-e3.yaml",
        "evospec-e3.yaml",
        "nanospec-evospec-e3.yaml",
        "vocabtrim.yaml",
        "vocabtrim-e3.yaml",
        "dynaspec.yaml",
        "dynaspec-e3.yaml",
        "specvocab.yaml",
        "specvocab-e3.yaml",
        "clora-e3.yaml",
        "osd-e3.yaml",
        "evospec-full-e3.yaml",
    ],
)
def test_cpu_presets_measure_their_tree(name: str) -> None:
    """A 4/4/16 tree (17 verified rows a round) decoded at 0.22x plain decoding on a CPU (wave 41):
    the CPU presets serve the shape measured on the machine."""
    cfg = load_config(CONFIGS / name)
    assert cfg.draft is None and cfg.device == "cpu"  # the model's shipped head
    assert cfg.tune_tree is True and cfg.tunes_tree and cfg.tree == TreeConfig()
    assert cfg.vocab.indices is None  # $EVOSPEC_HOME/indices/<model>


def test_sections_are_the_engine_configs() -> None:
    """One schema: the YAML sections are the engine's dataclasses; program-set fields are no keys."""
    from evospec.settings import user_fields

    assert ServeConfig().tree == TreeConfig() and ServeConfig().vocab == VocabConfig()
    assert ServeConfig().adapt == AdaptConfig()
    internal = {f.name for c in (TreeConfig, VocabConfig, AdaptConfig) for f in fields(c)} - {
        f.name for c in (TreeConfig, VocabConfig, AdaptConfig) for f in user_fields(c)
    }
    assert internal == {"synchronous", "mode", "asynchronous"}  # a test switch; the method's mode


def test_vocab_section(tmp_path: Path) -> None:
    text = (
        "method: evospec\n"
        "vocab:\n  frspec_k: 16\n  core_k: 12\n  arc_capacity: 8\n  arc_p_init: 4\n  n_sem: 0\n"
        "  persist: false\n  indices: ~/idx\n"
    )
    cfg = load_config(_write(tmp_path, text))
    assert cfg.vocab.indices == "~/idx"
    vc = cfg.vocab
    got = (vc.frspec_k, vc.core_k, vc.arc_capacity, vc.arc_p_init, vc.n_sem, vc.persist)
    assert got == (16, 12, 8, 4, 0, False)
    assert vc.synchronous is False and vc.w_max == VocabConfig.w_max  # unset keys keep the defaults
    assert load_config(_write(tmp_path, "vocab: {frspec_k: null}\n")).vocab.frspec_k is None


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
        ("max_batch: 0\n", "max_batch must be >= 1"),
        ("max_batch: 2.5\n", "max_batch must be int"),
        ("max_batch: many\n", "max_batch must be >= 1 (1: one request at a time) or 'auto', got 'many'"),
        ("prefill_chunk: 0\n", "prefill_chunk must be >= 1"),
        ("request_timeout: 0\n", "request_timeout must be > 0"),
        ("max_tokens_limit: -1\n", "max_tokens_limit must be >= 1"),
        ("dtype: float8\n", "dtype 'float8'"),
        ("pack_weights: 1\n", "pack_weights must be bool"),
        ("prefix_cache_mb: -2\n", "prefix_cache_mb must be >= 0"),
        ("prefix_cache_mb: lots\n", "prefix_cache_mb must be int"),
        ("verify_logits: some\n", "verify_logits 'some' is not one of"),
        ("draft_weights: int2\n", "draft_weights 'int2' is not one of"),
        ("prefetch: l2\n", "prefetch 'l2': use auto or HINT[:KIB]"),
        ("prefetch: 't1:0.01'\n", "prefetch 't1:0.01': use auto or HINT[:KIB]"),
        ("tree: {top_k: 0}\n", "tree.top_k must be an integer >= 1"),
        ("tree: {width: 3}\n", "unknown tree key(s) ['width']"),
        ("tree: 5\n", "tree must be a mapping"),
        ("tree: {min_prob: 1.5, top_k: 1}\n", "tree.min_prob must be a number in [0, 1)"),
        ("tree: {min_prob: 0.3}\n", "tree.min_prob stops chains: it needs tree.top_k 1"),
        ("tree: {min_prob: high, top_k: 1}\n", "tree.min_prob must be float"),
        ("tree: {sample_drafts: 1, top_k: 1}\n", "tree.sample_drafts must be bool"),
        ("vocab: {arc_size: 3}\n", "unknown vocab key(s) ['arc_size']"),
        ("vocab: 5\n", "vocab must be a mapping"),
        ("vocab: {w_max: '3072'}\n", "vocab.w_max must be int"),
        ("vocab: {w_max: 3.5}\n", "vocab.w_max must be int"),
        ("vocab: {k_pre: true}\n", "vocab.k_pre must be int"),
        ("vocab: {persist: 1}\n", "vocab.persist must be bool"),
        ("vocab: {frspec_k: x}\n", "vocab.frspec_k must be int or null"),
        ("vocab: {indices: 3}\n", "vocab.indices must be str or null"),
        ("vocab: {indices: ''}\n", "vocab.indices must not be empty"),
        ("vocab: {w_max: 0}\n", "vocab.w_max must be >= 1"),
        ("vocab: {frspec_k: 0}\n", "vocab.frspec_k must be >= 1"),
        ("vocab: {core_k: 0}\n", "vocab.core_k must be >= 1"),
        ("vocab: {core_k: 2.5}\n", "vocab.core_k must be int or null"),
        ("vocab: {arc_ghost: -1}\n", "vocab.arc_ghost must be >= 0"),
        ("vocab: {max_pending: 0}\n", "vocab.max_pending must be >= 1"),
        ("vocab: {cluster_budget: 0}\n", "vocab.cluster_budget must be >= 1"),
        ("vocab: {candidates: 0}\n", "vocab.candidates must be >= 1"),
        ("method: nanospec+evospec\nvocab: {w_max: 256}\n", "it must exceed vocab.arc_capacity (256)"),
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


def test_adapt_mode_follows_the_method_not_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("unknown adapt key(s) ['mode']")):
        load_config(_write(tmp_path, "method: osd\nadapt: {mode: clora}\n"))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("  lr: 0\n", "adapt.lr must be > 0"),
        ("  scope: tenant\n", "adapt.scope 'tenant' is not one of"),
        ("  rank: 2.5\n", "adapt.rank must be int"),
        ("  seed: abc\n", "adapt.seed must be int"),
        ("  buffer: 32\n", "unknown adapt key(s) ['buffer']"),
    ],
)
def test_adapt_section_errors_name_the_key(tmp_path: Path, section: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("method: clora\nadapt:\n" + section)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(path)

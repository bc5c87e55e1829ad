"""The index tables shipped for the default model: intact (sizes and sha256 as their manifest
says), small, counted from redistributable sets only (each listed with its license, the ones
left out with the reason), packaged into the wheel; and (slow) a fresh install -- no shared data,
an empty $EVOSPEC_HOME -- assembles every vocabulary method from them."""

from __future__ import annotations

import fnmatch
import shutil
import tomllib
from pathlib import Path

import pytest

import indices.default as default
from evospec.common import DEFAULT_DATA
from evospec.models.registry import DEFAULT_MODEL
from indices.corpus import REDISTRIBUTABLE, TRAINING_SOURCES
from indices.manifest import BIGRAM_FILE, OPTIONAL_FILES, IndexLoadError
from indices.packaged import NOTICE_FILE, PACKAGED_FILES, PACKAGED_ROOT, packaged_dirs, read_packaged

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = PACKAGED_ROOT / DEFAULT_MODEL
MAX_BYTES = 10_000_000  # what the tables may weigh in the wheel, all files together
REFUSED = ("SA", "NC", "ND", "unclear")  # license terms whose sets must never ship


def test_default_model_ships_intact_tables() -> None:
    assert SHIPPED in packaged_dirs()
    tables = read_packaged(SHIPPED)  # checks every listed file's size and sha256
    m = tables.manifest
    assert m.model_name == DEFAULT_MODEL and m.vocab_size == tables.counts.size == 49152
    assert m.hnsw is None and set(m.files) == {*PACKAGED_FILES, *OPTIONAL_FILES}  # HNSW: built on first use
    assert tables.graph.num_edges == m.num_edges > 50_000 and tables.counts.sum() == m.corpus.num_tokens
    size = sum(e.size for e in m.files.values()) + (SHIPPED / "manifest.json").stat().st_size
    assert size < MAX_BYTES


def test_shipped_sources_are_listed_with_licenses_that_allow_it() -> None:
    c = read_packaged(SHIPPED).manifest.corpus
    assert [s.name for s in c.sources] == list(REDISTRIBUTABLE)
    for s in c.sources:
        src = TRAINING_SOURCES[s.name]
        assert src.redistributable and s.license == src.license and src.upstream in s.origin
        assert not any(term in s.license for term in REFUSED), s
        assert s.num_documents > 0 and s.num_tokens > 0
    assert sum(s.num_tokens for s in c.sources) == c.num_tokens
    assert sum(s.num_documents for s in c.sources) == c.num_documents
    left_out = {n for n, s in TRAINING_SOURCES.items() if not s.redistributable}
    assert set(c.left_out) == left_out >= {"t0_sample", "flores200_deen", "ntrex128_deen"}
    assert c.command.startswith(f"evospec-index package --model {DEFAULT_MODEL} --training-data ")
    notice = (SHIPPED / NOTICE_FILE).read_text()
    assert all(s.name in notice and s.license in notice for s in c.sources)


def test_every_redistributable_source_is_permissive_and_the_rest_are_not() -> None:
    for name, s in TRAINING_SOURCES.items():
        refused = any(term in s.license for term in REFUSED) or "mixed" in s.license
        assert s.redistributable != refused, name


def test_wheel_includes_the_tables() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["indices"]
    for f in [*PACKAGED_FILES, "manifest.json", NOTICE_FILE]:
        rel = (SHIPPED / f).relative_to(ROOT / "indices").as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel


def test_an_altered_table_is_refused(tmp_path: Path) -> None:
    copy = tmp_path / DEFAULT_MODEL
    shutil.copytree(SHIPPED, copy)
    raw = bytearray((copy / BIGRAM_FILE).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (copy / BIGRAM_FILE).write_bytes(bytes(raw))
    with pytest.raises(IndexLoadError, match="sha256 mismatch"):
        read_packaged(copy)


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_DATA.is_dir(), reason="needs the shared data folder")
def test_rebuild_reproduces_the_shipped_tables(default_model, tmp_path: Path) -> None:
    """``evospec-index package`` gives the same bytes again (~30 s)."""
    from indices.packaged import build_packaged

    out = tmp_path / "packaged"
    m = build_packaged(
        default_model.model.lm_head.weight,
        default_model.codec,
        DEFAULT_DATA,
        out,
        model_name=DEFAULT_MODEL,
        progress=False,
    )
    shipped = read_packaged(SHIPPED).manifest.files  # the optional files are added to it later
    assert m.files == {name: shipped[name] for name in PACKAGED_FILES}


@pytest.mark.slow
def test_fresh_install_assembles_every_vocabulary_method(tmp_path: Path, monkeypatch) -> None:
    """No shared data, an empty $EVOSPEC_HOME (but the converted model, linked): each vocabulary
    method assembles from the shipped tables plus an HNSW index built on first use, and decodes
    the same greedy tokens as ar (~1-3 minutes on 2 cores)."""
    from evospec.assembly import StackSettings, assemble
    from evospec.common import evospec_home
    from evospec.decoding.sampling import SamplingParams
    from evospec.decoding.tree import TreeConfig
    from evospec.models.registry import REGISTRY, ensure_converted
    from evospec.vocab.config import VocabConfig

    ensure_converted(REGISTRY[DEFAULT_MODEL], progress=False)  # in the real cache, before it moves
    models = evospec_home() / "models"
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models)
    monkeypatch.setenv("EVOSPEC_HOME", str(home))
    monkeypatch.setattr(default, "DEFAULT_DATA", tmp_path / "no-shared-data")
    monkeypatch.setattr(default, "training_texts", None)  # reading any shared data would fail

    methods = ("ar", "frspec", "nanospec", "evospec", "nanospec+evospec", "evospec-full")
    settings = StackSettings(
        model=DEFAULT_MODEL, methods=methods, tree=TreeConfig(4, 3, 8), vocab=VocabConfig(synchronous=True)
    )
    stack = assemble(settings, progress=False)
    try:
        bundle = stack.indices
        assert bundle.directory == home / "indices" / DEFAULT_MODEL and bundle.hnsw is not None
        assert [s.name for s in bundle.manifest.corpus.sources] == list(REDISTRIBUTABLE)
        assert list(stack.decoders) == list(methods)
        ids = stack.codec.encode_chat([{"role": "user", "content": "Name three colours."}])
        params = SamplingParams(max_new_tokens=12)
        want = [t for ev in stack.decoder("ar").generate(ids, params) for t in ev.tokens]
        for name in methods[1:]:
            assert [t for ev in stack.decoder(name).generate(ids, params) for t in ev.tokens] == want, name
    finally:
        for dec in stack.decoders.values():
            dec.close()


def test_the_shipped_router_and_selector_fit_the_shipped_clusters_and_model() -> None:
    """What the dynaspec / specvocab policies check at load time holds for what ships."""
    import numpy as np

    from evospec.vocab.router import load_router
    from evospec.vocab.selector import load_selector
    from indices.manifest import CLUSTERS_FILE, DYNASPEC_FILE, SPECVOCAB_FILE, load_optional_file

    m = read_packaged(SHIPPED).manifest
    clusters = np.load(SHIPPED / CLUSTERS_FILE).astype(np.int64)
    assert clusters.shape == (m.vocab_size,) and set(np.unique(clusters)) == set(range(256))
    router = load_router(
        load_optional_file(SHIPPED / DYNASPEC_FILE), clusters=clusters, fingerprint=m.model_fingerprint
    )
    selector = load_selector(
        load_optional_file(SHIPPED / SPECVOCAB_FILE),
        vocab_size=m.vocab_size,
        dim=m.hidden_size,
        fingerprint=m.model_fingerprint,
    )
    assert router.clusters == 256 and selector.rank == 64
    for name in (DYNASPEC_FILE, SPECVOCAB_FILE):  # each says how it was trained and what it reached
        rec = m.extras[name]
        assert rec["command"].startswith("evospec train-vocab") and rec["train_log"]["epochs"], name

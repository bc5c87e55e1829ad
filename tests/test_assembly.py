"""The one assembly: settings in, a Stack of decoders out -- the same for generate, bench, serve;
``auto`` resolves to the fastest measured method, or ar."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from evospec.assembly import AUTO, StackSettings, assemble
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for, save_eagle
from evospec.tokenizer import TextCodec
from tests.decoding.spec_helpers import steps_of, tiny_target
from tests.indices.helpers import write_model_folder
from tests.vocab.helpers import SMALL


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model folder with the default model's tokenizer, and a random draft head for it."""
    from evospec.models.registry import DEFAULT_MODEL, REGISTRY, ensure_converted

    codec = TextCodec.from_folder(ensure_converted(REGISTRY[DEFAULT_MODEL], progress=False))
    tiny = tiny_target(0, ctx=256, vocab=codec.vocab_size, eos=codec.eos_ids)
    root = tmp_path_factory.mktemp("assembly")
    model = write_model_folder(root / "tiny-model", tiny, codec)
    head = save_eagle(new_eagle_for(tiny, seed=3), root / "head", dtype=torch.float32)
    return model, head


def _tokens(dec, ids, n=10) -> list[int]:
    return [t for ev in dec.generate(ids, SamplingParams(max_new_tokens=n)) for t in ev.tokens]


def test_one_stack_serves_every_named_method(folder, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))  # nothing may be written outside it
    model, head = folder
    settings = StackSettings(
        model=str(model),
        methods=("ar", "nanospec", "eagle2"),
        draft=str(head),
        tree=TreeConfig(4, 3, 8),
        vocab=SMALL,
    )
    stack = assemble(settings, progress=False)
    try:
        assert list(stack.decoders) == ["ar", "nanospec", "eagle2"]
        assert stack.draft_path == head and stack.indices is None  # neither method reads indices
        assert stack.facts[0].startswith("model: tiny-model from ") and f"draft head: {head}" in stack.facts
        assert any(f.startswith("draft vocabulary: policy=nanospec") for f in stack.facts)
        ids = stack.codec.encode("The quick brown fox")
        want = _tokens(stack.decoder("ar"), ids)
        assert _tokens(stack.decoder("nanospec"), ids) == want == _tokens(stack.decoder("eagle2"), ids)
        assert stack.decoder("eagle2").tree == TreeConfig(4, 3, 8) and stack.decoder("ar").tree is None
    finally:
        for dec in stack.decoders.values():
            dec.close()


def test_settings_are_checked_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        StackSettings(methods=("medusa",))
    with pytest.raises(ValueError, match=r"must exceed vocab\.arc_capacity"):
        StackSettings(methods=("nanospec+evospec",), vocab=SMALL.__class__(w_max=64, arc_capacity=64))
    with pytest.raises(ValueError, match="dtype 'int3'"):
        StackSettings(dtype="int3")


def test_a_model_without_tokenizer_is_one_clear_error(folder, tmp_path) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder[0], bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        assemble(StackSettings(model=str(bare)), progress=False)


def test_speculative_methods_need_a_head(folder) -> None:
    with pytest.raises(ValueError, match="need a draft head"):
        assemble(StackSettings(model=str(folder[0]), methods=("eagle2",)), progress=False)


@pytest.mark.parametrize(
    ("speedups", "chosen"),
    [
        ({"nanospec": 1.4, "eagle2": 1.1, "ngram": 1.2}, "nanospec"),
        ({"nanospec": 1.1, "eagle2": 1.1, "ngram": 1.2}, "ngram"),
        ({"nanospec": 0.9, "eagle2": 0.97, "ngram": 0.99}, "ar"),
        ({"nanospec": 1.03, "eagle2": 0.97, "ngram": 1.0}, "ar"),  # within the calibration's noise margin
    ],
)
def test_auto_picks_the_fastest_method_or_falls_back_to_ar(folder, monkeypatch, speedups, chosen) -> None:
    """A fake timer: each candidate's calibration reports the given speedup over AR."""
    import indices.default
    from evospec.decoding import tune

    seen = []

    def fake_tuning(self, method):
        seen.append(method)
        return {
            "tree": {"top_k": 2, "depth": 2, "total_tokens": 3},
            "tok_per_s": speedups[method],
            "ar_tok_per_s": 1.0,
        }

    def no_indices(*a, **kw):
        raise FileNotFoundError("no shared data folder")

    monkeypatch.setattr(tune.Tuner, "tuning_steps", steps_of(fake_tuning))
    monkeypatch.setattr(
        tune.Tuner, "final_steps", steps_of(lambda self, names, trees: {n: speedups[n] for n in names})
    )
    monkeypatch.setattr(indices.default, "ensure_indices", no_indices)
    model, head = folder
    stack = assemble(StackSettings(model=str(model), methods=(AUTO,), draft=str(head)), progress=False)
    assert seen == ["nanospec", "eagle2", "ngram"]  # frspec and evospec need indices, unavailable here
    assert stack.resolved == {AUTO: chosen} and stack.decoder(AUTO).name == chosen
    assert list(stack.decoders) == [chosen]
    if chosen != "ar":  # the shape the choice was measured with (ngram: with its default lookup)
        assert dataclasses.replace(stack.decoder(AUTO).tree, lookup=0) == TreeConfig(2, 2, 3)
    assert any(f.startswith(f"method auto: {chosen} ") for f in stack.facts)
    assert any(f.startswith("indices unavailable") for f in stack.facts)
    stack.decoder(AUTO).close()


def test_a_retrained_head_is_tuned_afresh(folder, tmp_path) -> None:
    import shutil

    from evospec.assembly import head_id

    copy = tmp_path / "head"
    shutil.copytree(folder[1], copy)
    assert head_id(copy) == head_id(folder[1]) and head_id(None) == "none"
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    assert head_id(copy) != head_id(folder[1])


@pytest.mark.parametrize(("ngram", "chosen"), [(1.3, "ngram"), (0.98, "ar")])
def test_auto_without_a_head_chooses_between_ar_and_ngram(
    folder, tmp_path, monkeypatch, ngram, chosen
) -> None:
    from evospec.decoding import tune

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))  # the indices auto may build land here
    seen = []

    def fake_tuning(self, method):
        seen.append(method)
        return {
            "tree": {"top_k": 1, "depth": 1, "total_tokens": 1, "lookup": 3},
            "tok_per_s": ngram,
            "ar_tok_per_s": 1.0,
        }

    monkeypatch.setattr(tune.Tuner, "tuning_steps", steps_of(fake_tuning))
    monkeypatch.setattr(
        tune.Tuner, "final_steps", steps_of(lambda self, names, trees: {n: ngram for n in names})
    )
    stack = assemble(StackSettings(model=str(folder[0]), methods=(AUTO,)), progress=False)
    assert seen == ["ngram"]  # the methods with a draft need a head
    assert stack.resolved == {AUTO: chosen} and stack.decoder(AUTO).name == chosen
    assert any("auto chooses between ar and ngram" in f for f in stack.facts)


def test_a_fresh_install_counts_the_users_corpus(folder, tmp_path, monkeypatch) -> None:
    """No shared data and no tables shipped for this model: frspec names the way out (a corpus of
    one's own); with ``vocab.corpus`` the indices are counted from those files on first use."""
    import dataclasses

    import indices.default
    from indices.manifest import IndexLoadError

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(indices.default, "DEFAULT_DATA", tmp_path / "no-shared-data")
    model, head = folder
    with pytest.raises(IndexLoadError, match="--corpus FILES"):
        assemble(
            StackSettings(model=str(model), methods=("frspec",), draft=str(head), vocab=SMALL), progress=False
        )
    corpus = tmp_path / "mine.txt"
    corpus.write_text("The cat sat on the mat.\n\nThe dog sat on the log.")
    with pytest.raises(ValueError, match=r"vocab\.corpus must name"):
        dataclasses.replace(SMALL, corpus=" , ")
    vocab = dataclasses.replace(SMALL, corpus=f"{corpus}, {corpus}")
    assert vocab.corpus_paths == (str(corpus), str(corpus))
    stack = assemble(
        StackSettings(model=str(model), methods=("frspec",), draft=str(head), vocab=vocab), progress=False
    )
    try:
        m = stack.indices.manifest
        assert m.corpus.description.startswith(f"corpus files {corpus}") and m.corpus.num_tokens > 10
        assert any(f.startswith("indices: ") and "corpus files" in f for f in stack.facts)
    finally:
        stack.decoder("frspec").close()


def test_the_models_ngram_table_is_found_named_or_turned_off(folder, tmp_path, monkeypatch) -> None:
    """``build-ngrams``' output for the model is read by default and ngram verifies its guesses;
    ``ngrams="none"`` serves without it; a table of another vocabulary is refused by name."""
    from evospec.decoding.ngram_table import NgramTable, user_table_path

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    model, _ = folder
    plain = assemble(StackSettings(model=str(model), methods=("ar", "ngram")), progress=False)
    assert plain.decoder("ngram").ngrams is None  # no table built, none ships for a tiny model
    ids = plain.codec.encode("The quick brown fox")
    answers = [_tokens(plain.decoder("ar"), plain.codec.encode(t), 24) for t in ("A cat", "One dog", "Hi")]
    vocab = plain.loaded.model.cfg.vocab_size
    NgramTable.count(answers, model="tiny-model", vocab_size=vocab, min_count=1).save(
        user_table_path("tiny-model")
    )
    stack = assemble(StackSettings(model=str(model), methods=("ar", "ngram")), progress=False)
    dec = stack.decoder("ngram")
    assert dec.ngrams is not None and dec.tree.table_lookup == 1
    assert any(f.startswith(f"n-gram table: {user_table_path('tiny-model')}") for f in stack.facts)
    assert _tokens(dec, ids, 24) == _tokens(stack.decoder("ar"), ids, 24)
    off = assemble(StackSettings(model=str(model), methods=("ngram",), ngrams="none"), progress=False)
    assert off.decoder("ngram").ngrams is None
    other = tmp_path / "other.safetensors"
    NgramTable.count([[1, 2, 3]], model="x", vocab_size=vocab + 1, min_count=1).save(other)
    with pytest.raises(ValueError, match="vocab_size"):
        assemble(StackSettings(model=str(model), methods=("ngram",), ngrams=str(other)), progress=False)


def test_a_rebuilt_table_is_tuned_afresh(tmp_path) -> None:
    """The tuning key names a table file by a hash of its bytes, as it names a head's weights."""
    from evospec.assembly import head_id
    from evospec.decoding.ngram_table import NgramTable

    a, b = tmp_path / "a" / "t.safetensors", tmp_path / "b" / "t.safetensors"
    NgramTable.count([[1, 2, 3]], model="m", vocab_size=8, min_count=1).save(a)
    NgramTable.count([[1, 2, 4]], model="m", vocab_size=8, min_count=1).save(b)
    assert head_id(a).startswith("t.safetensors@") and head_id(a) != head_id(b)


def test_the_weights_line_says_what_int4_rounded_and_what_it_read_as_it_is() -> None:
    """A checkpoint's own 4-bit codes are read as they are; weights rounded to 4 bits from its
    floats (a GGUF's 5-8-bit tensors, a float folder) are counted, with the way to keep 8."""
    from types import SimpleNamespace

    from evospec.assembly import describe_weights
    from evospec.models.quant import GroupCodes, QuantReport, quantize_linears

    holder = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 32, bias=False))
    report = quantize_linears(holder, "int4", {"0.weight": GroupCodes.from_float(torch.randn(32, 64))})
    assert (report.linears, report.from_codes, report.requantised) == (2, 1, 1)
    line = describe_weights(SimpleNamespace(quant=report, weights="int4", model=holder))
    assert "1 from the checkpoint's 4-bit codes, 1 rounded to 4 bits from its floats (--weights int8" in line
    faithful = QuantReport(linears=211, from_codes=210, nbytes=95_000_000)
    assert "rounded" not in describe_weights(SimpleNamespace(quant=faithful, weights="int4", model=holder))
    assert describe_weights(SimpleNamespace(quant=None, weights="fp32", model=holder)) == "weights fp32"
    compact = SimpleNamespace(quant=faithful, weights="int4", model=holder, embedding_bytes_freed=83_000_000)
    assert describe_weights(compact).endswith("; token embedding as int8 codes, exact (83 MB freed)")


def test_assembly_hands_freed_heap_back_once_everything_is_loaded(folder, tmp_path, monkeypatch) -> None:
    """Loading frees the float weights quantisation replaces; glibc keeps them unless told, so the
    stack trims the heap once, after the decoders' graphs are recorded."""
    import evospec.assembly as assembly_mod

    monkeypatch.setenv("EVOSPEC_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(assembly_mod, "trim_heap", lambda: calls.append("trim") or True)
    model, _ = folder
    stack = assemble(StackSettings(model=str(model), methods=("ar",)), progress=False)
    assert calls == ["trim"] and list(stack.decoders) == ["ar"]


def test_trim_heap_gives_freed_heap_back_under_glibc() -> None:
    import platform

    from evospec.common import trim_heap

    junk = [bytearray(1 << 16) for _ in range(256)]  # 16 MB of malloc'd blocks, then freed
    del junk
    gave = trim_heap()  # never raises, glibc or not
    assert gave is True if platform.libc_ver()[0] == "glibc" else gave is False

"""The adapter file format: what a saved adapter holds, and every file the reader refuses; the
bytes-level reader names the source it was given; a failed write keeps the previous file.

The round trip through a live adapter (save, reset, load into a fresh decoder) is in
``test_online.py``; these tests write and read files directly.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from evospec.adapt.adapter_file import (
    FORMAT,
    adapter_bytes,
    head_signature,
    parse_adapter,
    read_adapter,
    write_adapter,
)
from evospec.adapt.config import AdaptConfig
from evospec.models.eagle import new_eagle_for
from tests.decoding.spec_helpers import tiny_target

CLORA = AdaptConfig(mode="clora", rank=4, alpha=4)
TENSORS = {"layers.0.self_attn.q_proj.lora_A.weight": torch.arange(12.0).reshape(4, 3).T}  # not contiguous
TENSORS_CONTIGUOUS = {n: t.contiguous() for n, t in TENSORS.items()}


def _metadata(path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_round_trip_keeps_tensors_and_writes_the_header(head, tmp_path):
    path = write_adapter(tmp_path / "nested" / "a.safetensors", TENSORS, CLORA, head, version=3)
    assert path == tmp_path / "nested" / "a.safetensors"  # parent folders are created
    got = read_adapter(path, CLORA, head)
    assert set(got) == set(TENSORS)
    for name, t in TENSORS.items():
        assert torch.equal(got[name], t) and got[name].device.type == "cpu"
    assert _metadata(path) == {
        "format": FORMAT,
        "mode": "clora",
        "rank": "4",
        "alpha": "4",
        "version": "3",
        "head": json.dumps(head_signature(head)),
    }
    c = head.cfg
    assert head_signature(head) == {
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
    }


def test_a_missing_file_is_not_found(head, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter file not found"):
        read_adapter(tmp_path / "missing.safetensors", CLORA, head)


def test_a_file_that_is_not_safetensors_is_refused(head, tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_adapter(junk, CLORA, head)


def test_another_format_is_refused(head, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "other/1"})
    with pytest.raises(ValueError, match=r"not an EvoSpec adapter \(format 'other/1'\)"):
        read_adapter(path, CLORA, head)
    save_file({"x": torch.zeros(2)}, str(path))  # no metadata at all
    with pytest.raises(ValueError, match=r"not an EvoSpec adapter \(format None\)"):
        read_adapter(path, CLORA, head)


def test_another_mode_is_refused(head, tmp_path):
    path = write_adapter(tmp_path / "a.safetensors", TENSORS, CLORA, head, version=1)
    with pytest.raises(ValueError, match="a clora adapter cannot load into a osd adapter"):
        read_adapter(path, replace(CLORA, mode="osd"), head)


def test_lora_rank_and_alpha_must_match_under_clora_only(head, tmp_path):
    path = write_adapter(tmp_path / "a.safetensors", TENSORS, CLORA, head, version=1)
    with pytest.raises(ValueError, match=r"LoRA rank/alpha 4/4 != configured 2/4"):
        read_adapter(path, replace(CLORA, rank=2), head)
    with pytest.raises(ValueError, match=r"LoRA rank/alpha 4/4 != configured 4/8"):
        read_adapter(path, replace(CLORA, alpha=8), head)
    osd = replace(CLORA, mode="osd")
    path = write_adapter(tmp_path / "o.safetensors", TENSORS, osd, head, version=1)
    assert set(read_adapter(path, replace(osd, rank=2, alpha=8), head)) == set(TENSORS)  # osd has no LoRA


def test_a_file_for_another_head_is_refused(head, tmp_path):
    path = write_adapter(tmp_path / "a.safetensors", TENSORS, CLORA, head, version=1)
    other = new_eagle_for(tiny_target(0, vocab=32))
    with pytest.raises(ValueError, match="saved for a different draft head"):
        read_adapter(path, CLORA, other)


def test_bytes_round_trip_and_name_the_source(head):
    data = adapter_bytes(TENSORS, CLORA, head, version=2)
    got = parse_adapter(data, CLORA, head, "mine")
    assert all(torch.equal(got[n], t) for n, t in TENSORS.items())
    with pytest.raises(ValueError, match=r"^mine: not a readable safetensors file"):
        parse_adapter(data[: len(data) // 2], CLORA, head, "mine")
    with pytest.raises(ValueError, match=r"^mine: LoRA rank/alpha 4/4 != configured 2/4"):
        parse_adapter(data, replace(CLORA, rank=2), head, "mine")


def test_unreadable_metadata_is_refused_not_raised_as_another_error(head, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "a.safetensors"
    save_file(TENSORS_CONTIGUOUS, str(path), metadata={"format": FORMAT, "mode": "clora", "rank": "four"})
    with pytest.raises(ValueError, match="unreadable adapter metadata"):
        read_adapter(path, CLORA, head)


def test_a_write_that_fails_keeps_the_previous_file(head, tmp_path, monkeypatch):
    import evospec.files

    path = write_adapter(tmp_path / "a.safetensors", TENSORS, CLORA, head, version=1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(evospec.files.os, "replace", crash)
    with pytest.raises(OSError):
        write_adapter(path, TENSORS, CLORA, head, version=2)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]

"""Pages of a checkpoint's mapping given back once quantisation dropped its floats: only file
pages, only of tensors the model no longer holds, and every value reads back the same."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from torch import nn

from evospec.models.file_pages import mapped_weights, release_dropped

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page mappings")

PAGE = mmap.PAGESIZE


def _mapped(tmp_path, values: torch.Tensor) -> torch.Tensor:
    """``values`` as a view into a private mapping of a file holding them (safetensors' way)."""
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=values.dtype)  # keeps the mapping alive


def _model(**tensors: torch.Tensor) -> nn.Module:
    model = nn.Module()
    for name, t in tensors.items():
        model.register_buffer(name, t)
    return model


def test_a_dropped_file_mapped_weight_gives_its_pages_back_and_reads_the_same(tmp_path):
    values = torch.arange(8 * PAGE // 4, dtype=torch.float32)
    dropped = _mapped(tmp_path, values)
    assert torch.equal(dropped, values)  # every page touched, as quantisation reads them
    freed = release_dropped(_model(norm=torch.ones(4)), [dropped])
    assert freed >= 7 * PAGE  # its whole pages (the first may start past a boundary)
    assert torch.equal(dropped, values)  # read back from the file


def test_anonymous_memory_and_weights_still_held_are_never_touched(tmp_path):
    anon = torch.arange(8 * PAGE // 4, dtype=torch.float32)
    assert release_dropped(_model(norm=torch.ones(4)), [anon]) == 0
    assert torch.equal(anon, torch.arange(8 * PAGE // 4, dtype=torch.float32))
    values = torch.arange(8 * PAGE // 4, dtype=torch.float32)
    held = _mapped(tmp_path, values)
    assert release_dropped(_model(w=held[: PAGE // 4]), [held]) == 0  # a view of it lives on
    assert torch.equal(held, values)


def test_only_file_mapped_floats_are_noted(tmp_path):
    """What quantisation may drop and a file holds: the floats in a mapping, not anonymous ones
    (holding those would keep them alive through quantisation)."""
    lin = nn.Linear(4, 3)
    mapped = _mapped(tmp_path, torch.arange(2 * PAGE // 4, dtype=torch.float32))
    lin.weight = nn.Parameter(mapped[:12].view(3, 4), requires_grad=False)
    got = mapped_weights(nn.Sequential(lin, nn.Embedding(5, 4)))
    assert len(got) == 1 and got[0] is lin.weight  # not the bias, not the embedding

"""``evospec/common.py``: files written as readable as any other, output paths checked early."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from evospec.common import check_output, current_umask, save_tensors


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_safetensors_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    """safetensors 0.8 creates its files 0600 whatever the umask: a head or a table written in a
    Docker build could not be read by the server running as another user."""
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        save_tensors({"a": torch.zeros(2)}, tmp_path / "t.safetensors", metadata={"k": "v"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o666 & ~umask


def test_a_saved_head_and_table_are_readable_by_others(tmp_path: Path) -> None:
    from evospec.decoding.ngram_table import NgramTable

    old = os.umask(0o022)
    try:
        NgramTable.count([[1, 2, 1, 2, 1, 2]], model="m", vocab_size=8).save(tmp_path / "n.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "n.safetensors").stat().st_mode) == 0o644


def test_output_paths(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    check_output(None, "--json")
    check_output(tmp_path / "new" / "deeper" / "r.json", "--json")  # missing parents: made later
    check_output(tmp_path / "plots", "--plots", folder=True)
    check_output(tmp_path, "--plots", folder=True)
    with pytest.raises(ValueError, match=r"--json .* is a folder; name a file"):
        check_output(tmp_path, "--json")
    with pytest.raises(ValueError, match=r"--out .* is a file, not a folder"):
        check_output(tmp_path / "f", "--out", folder=True)
    with pytest.raises(ValueError, match=r"--out .*: .*f is a file, not a folder"):
        check_output(tmp_path / "f" / "x" / "y.safetensors", "--out")

"""scripts/prefetch_ab.py's entry syntax: ``STREAMED[/KEPT][@KV]``, a streamed setting, a kept hint
and the keys the attention prefetches ahead."""

from __future__ import annotations

import pytest

from evospec.kernels.prefetch import Setting
from tests.script_modules import SCRIPTS, load_script


def test_an_entry_names_the_streamed_setting_the_kept_hint_and_the_keys_ahead(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports tree_ab.py from its folder, as when run
    pair = load_script("prefetch_ab").hint_pair
    assert pair("nta") == (Setting("nta"), "t0", 64)
    assert pair("t0/t1") == (Setting("t0"), "t1", 64)
    assert pair("t1:10/t2") == (Setting("t1", 10240), "t2", 64)
    assert pair("t1:10@0") == (Setting("t1", 10240), "t0", 0)
    with pytest.raises(ValueError, match=r"0\.\.4096 keys ahead"):
        pair("t1@5000")
    with pytest.raises(ValueError, match="prefetch 'l2': use HINT"):
        pair("l2")
    with pytest.raises(ValueError, match="prefetch 't1:100': use HINT"):
        pair("t1:100")
    with pytest.raises(ValueError, match="'x' is not one of"):
        pair("t1/x")

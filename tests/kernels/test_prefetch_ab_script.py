"""scripts/prefetch_ab.py's hint syntax: ``STREAMED[/KEPT]``, each a known hint."""

from __future__ import annotations

import pytest

from tests.script_modules import SCRIPTS, load_script


def test_a_hint_names_the_streamed_and_the_kept_hint(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # it imports tree_ab.py from its folder, as when run
    pair = load_script("prefetch_ab").hint_pair
    assert pair("nta") == ("nta", "t0")
    assert pair("t0/t1") == ("t0", "t1")
    with pytest.raises(ValueError, match="'l2' is not one of"):
        pair("l2")
    with pytest.raises(ValueError, match="'x' is not one of"):
        pair("t1/x")

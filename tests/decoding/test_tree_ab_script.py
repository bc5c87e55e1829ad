"""scripts/tree_ab.py's variant syntax: chains, stopping chains and trees (``KxD[xT]``)."""

from __future__ import annotations

import pytest

from evospec.decoding.tree_config import TreeConfig
from tests.script_modules import load_script


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("frspec:3:2:1:1", ("frspec", TreeConfig(1, 1, 1, lookup=3, lookup_ngram=2, table_lookup=1))),
        ("eagle2:0:2:0:4:0.3", ("eagle2", TreeConfig(1, 4, 4, lookup=0, lookup_ngram=2, min_prob=0.3))),
        ("frspec:3:2:0:3x1", ("frspec", TreeConfig(3, 1, 3, lookup=3, lookup_ngram=2))),
        ("frspec:3:2:0:2x2x3@/heads/x", ("frspec", TreeConfig(2, 2, 3, lookup=3, lookup_ngram=2))),
        ("eagle2:0:2:0:10x5x60", ("eagle2", TreeConfig(10, 5, 60, lookup=0, lookup_ngram=2))),
    ],
)
def test_a_variant_names_its_method_and_tree(spec, want):
    assert load_script("tree_ab").variant_tree(spec) == want

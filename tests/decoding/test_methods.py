"""The method table: every method has one spec, and the decoder built for it has exactly the
parts its spec names (vocabulary policy, adapter, tree), readable through the Decoder protocol."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import METHOD_SPECS, METHODS, make_decoder, method_spec
from evospec.vocab.factory import POLICIES
from tests.decoding.spec_helpers import tiny_target
from tests.vocab.helpers import SMALL, stand_in_indices


def test_the_table_names_every_method_once() -> None:
    assert tuple(METHOD_SPECS) == METHODS and len(set(METHODS)) == len(METHODS)
    assert {s.policy for s in METHOD_SPECS.values()} - {None} == set(POLICIES)
    adaptive = {s.name: (s.policy, s.adapt) for s in METHOD_SPECS.values() if s.adapt}
    assert adaptive == {
        "clora": ("frspec", "clora"),
        "osd": ("frspec", "osd"),
        "evospec-full": ("evospec", "clora"),
    }
    assert [s.name for s in METHOD_SPECS.values() if s.has_arc] == [
        "evospec",
        "nanospec+evospec",
        "evospec-full",
    ]
    assert [s.name for s in METHOD_SPECS.values() if s.shares_budget] == ["nanospec+evospec"]
    assert (
        method_spec("evospec-full").drafts_like == "evospec" and method_spec("eagle2").drafts_like == "eagle2"
    )
    assert not method_spec("ar").speculative and not method_spec("ar").needs_indices
    assert method_spec("frspec").needs_counts and not method_spec("frspec").needs_hnsw
    assert method_spec("nanospec+evospec").needs_hnsw and not method_spec("nanospec").needs_indices
    with pytest.raises(ValueError, match="unknown method 'medusa'; available: ar, eagle2"):
        method_spec("medusa")


@pytest.mark.parametrize("name", METHODS)
def test_each_decoder_has_the_parts_its_spec_names(name: str) -> None:
    from evospec.adapt.config import AdaptConfig
    from evospec.models.eagle import new_eagle_for

    target = tiny_target(0)
    spec = method_spec(name)
    dec = make_decoder(
        name,
        target,
        draft=new_eagle_for(target, seed=1),
        vocab=SMALL,
        indices=stand_in_indices(target),
        adapt=AdaptConfig(asynchronous=False),
    )
    try:
        assert dec.name == name
        assert (dec.tree is not None) == spec.speculative
        assert (dec.vocab is not None) == spec.speculative
        if dec.vocab is not None:
            assert (dec.vocab.policy is None) == (spec.policy is None)
            assert spec.policy is None or dec.vocab.policy.name == spec.policy
        assert (dec.adapt is not None) == (spec.adapt is not None)
        assert dec.adapt is None or dec.adapt.cfg.mode == spec.adapt
    finally:
        dec.close()

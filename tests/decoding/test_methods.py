"""The method table: every method has one spec, and the decoder built for it has exactly the
parts its spec names (vocabulary policy, adapter, tree), readable through the Decoder protocol."""

from __future__ import annotations

import pytest

from evospec.decoding.methods import METHOD_SPECS, METHODS, make_decoder, method_spec
from evospec.models.quant import kernels_available
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
        "clora-e3": ("frspec", "clora"),
        "osd-e3": ("frspec", "osd"),
        "evospec-full-e3": ("evospec", "clora"),
    }
    assert [s.name for s in METHOD_SPECS.values() if s.has_arc] == [
        "evospec",
        "nanospec+evospec",
        "evospec-full",
        "evospec-e3",
        "nanospec+evospec-e3",
        "evospec-full-e3",
    ]
    assert [s.name for s in METHOD_SPECS.values() if s.shares_budget] == [
        "nanospec+evospec",
        "nanospec+evospec-e3",
    ]
    eagle3 = {s.name: s.policy for s in METHOD_SPECS.values() if s.head == "eagle3" and not s.adapt}
    assert eagle3 == {"eagle3": None, **{f"{p}-e3": p for p in POLICIES}}
    assert (
        method_spec("evospec-full").drafts_like == "evospec" and method_spec("eagle2").drafts_like == "eagle2"
    )
    assert method_spec("evospec-full-e3").drafts_like == "evospec-e3"  # tuned like the head's own policy
    assert not method_spec("ar").speculative and not method_spec("ar").needs_indices
    assert method_spec("frspec").needs_counts and not method_spec("frspec").needs_hnsw
    assert method_spec("nanospec+evospec").needs_hnsw and not method_spec("nanospec").needs_indices
    with pytest.raises(ValueError, match="unknown method 'medusa'; available: ar, eagle2"):
        method_spec("medusa")


@pytest.mark.parametrize("name", METHODS)
def test_each_decoder_has_the_parts_its_spec_names(name: str) -> None:
    from evospec.adapt.config import AdaptConfig
    from evospec.models.eagle import new_eagle_for
    from evospec.models.eagle3 import new_eagle3_for

    target = tiny_target(0)
    spec = method_spec(name)
    draft = new_eagle3_for(target, seed=1) if spec.head == "eagle3" else new_eagle_for(target, seed=1)
    dec = make_decoder(
        name,
        target,
        draft=draft,
        vocab=SMALL,
        indices=stand_in_indices(target),
        adapt=AdaptConfig(asynchronous=False),
    )
    try:
        assert dec.name == name
        assert (dec.tree is not None) == spec.speculative
        assert (dec.vocab is not None) == (spec.head is not None)  # ar and ngram draft nothing
        if spec.speculative and spec.head is None:
            assert dec.drafter is None and dec.tree.lookup > 0
        if dec.vocab is not None:
            assert (dec.vocab.policy is None) == (spec.policy is None)
            assert spec.policy is None or dec.vocab.policy.name == spec.policy
        assert (dec.adapt is not None) == (spec.adapt is not None)
        assert dec.adapt is None or dec.adapt.cfg.mode == spec.adapt
    finally:
        dec.close()


def _quantised(seed: int = 0):
    from evospec.models.quant import kernels_available, quantize_linears

    if not (kernels_available("int4") and kernels_available("int8")):
        pytest.skip("torch without CPU int4/int8 kernels")
    target = tiny_target(seed)
    quantize_linears(target, "int4")
    target.exact_rows = True
    return target


def _formats(head) -> set[str]:
    """The weight formats of ``head``'s linears (LoRA-wrapped ones count by their base layer)."""
    from torch import nn

    from evospec.models.quant import QuantLinear

    linears = [m for m in head.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    return {m.format if isinstance(m, QuantLinear) else "fp32" for m in linears}


def test_a_quantised_target_drafts_with_one_shared_int8_copy_of_the_head() -> None:
    from evospec.adapt.config import AdaptConfig
    from evospec.decoding.sampling import SamplingParams
    from evospec.models.eagle import new_eagle_for
    from tests.decoding.spec_helpers import ar_tokens, prompt_of

    target = _quantised()
    draft = new_eagle_for(target, seed=1)
    kw = dict(draft=draft, vocab=SMALL, indices=stand_in_indices(target))
    decs = [make_decoder(n, target, **kw) for n in ("eagle2", "frspec")]
    clora = make_decoder("clora", target, **kw, adapt=AdaptConfig(asynchronous=False))
    kept = make_decoder("eagle2", target, **kw, draft_weights="fp32")
    try:
        heads = [d.drafter.head for d in decs]
        assert heads[0] is heads[1] and heads[0] is not draft  # one int8 copy for both
        assert _formats(heads[0]) == {"int8"}
        assert _formats(draft) == {"fp32"}  # the original is untouched
        assert _formats(clora.drafter.head) == {"fp32"}  # LoRA needs the dense weights
        assert kept.drafter.head is draft
        params = SamplingParams(max_new_tokens=20)
        for seed in range(3):
            prompt = prompt_of(seed, 5 + seed)
            want = ar_tokens(target, prompt, params)
            for dec in (*decs, kept):
                assert [t for ev in dec.generate(prompt, params) for t in ev.tokens] == want
    finally:
        for d in (*decs, clora, kept):
            d.close()


def test_an_fp32_target_drafts_with_the_head_itself() -> None:
    from evospec.models.eagle import new_eagle_for

    target = tiny_target(0)
    draft = new_eagle_for(target, seed=1)
    dec = make_decoder("eagle2", target, draft=draft)
    assert dec.drafter.head is draft
    with pytest.raises(ValueError, match="draft_weights must be one of auto, fp32, int8, int4"):
        make_decoder("eagle2", target, draft=draft, draft_weights="int2")


@pytest.mark.parametrize("slow_rows", [False, True])
def test_trees_verified_through_recorded_tree_graphs_emit_plain_decodings_tokens(
    monkeypatch, slow_rows
) -> None:
    """On a fused int4 target whose step graphs take trees, fans (CPU-built, 2-4 children, with
    lookup), a depth-2 tree and EAGLE-2's default 10/5/60 tree verify in one recorded llama_stack
    op each, and frspec and eagle2 emit plain decoding's tokens; ``slow_rows``: every tree is
    verified with its bits computed from the mask in the forward (the fan's shared bits left out)."""
    import torch

    from evospec.decoding.recording import record_steps
    from evospec.decoding.sampling import SamplingParams
    from evospec.decoding.speculative import recorded_verify
    from evospec.decoding.tree import TreeConfig, _build_fan
    from evospec.models.eagle import new_eagle_for
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import quantize_linears
    from evospec.models.step import StepGraph
    from tests.decoding.spec_helpers import ar_tokens, prompt_of

    if not kernels_available("int4"):
        pytest.skip("torch without CPU int4 kernels")
    target = tiny_target(3, head_dim=64)
    quantize_linears(target, "int4")
    if not enable_fused_ops(target):
        pytest.skip("needs the op library")
    target.exact_rows = True
    target.step_graph = StepGraph(target)
    if not target.step_graph.trees:
        pytest.skip("tree graphs need our int4 kernel on every layer")
    if slow_rows:
        import evospec.decoding.tree as tree_module

        shape = tree_module._fan_shape
        monkeypatch.setattr(tree_module, "_fan_shape", lambda k: (*shape(k)[:3], None))
    draft = new_eagle_for(target, seed=2)
    params = SamplingParams(max_new_tokens=24)
    shapes = (TreeConfig(2, 1, 2), TreeConfig(4, 1, 4, lookup=3), TreeConfig(2, 2, 3), TreeConfig(10, 5, 60))
    decs = [
        make_decoder(m, target, draft=draft, vocab=SMALL, indices=stand_in_indices(target), tree=tree)
        for tree in shapes
        for m in ("frspec", "eagle2")
    ]
    record_steps(target, decs)
    recorded = set(target.step_graph._graphs)
    trees = {(3, "all", "tree"), (5, "all", "tree"), (4, "all", "tree"), (61, "all", "tree")}
    assert trees <= recorded  # fans of 2 and 4 children, a 3-node tree, EAGLE-2's default 60
    fan = _build_fan(1, torch.zeros(2), torch.tensor([3, 4]), 10, 2)
    # verified in a graph, every row projected there; with EAGLE-3's aux layers eagerly, rows lazily
    assert recorded_verify(target, fan) and not recorded_verify(target, fan, (0, 1))
    for seed, length in ((0, 6), (1, 17), (2, 40)):
        prompt = prompt_of(seed, length)
        want = ar_tokens(target, prompt, params)
        for dec in decs:
            assert [t for ev in dec.generate(prompt, params) for t in ev.tokens] == want
    assert set(target.step_graph._graphs) == recorded  # every tree verified through a graph recorded ahead


def test_a_fused_target_drafts_with_an_int4_copy_on_the_draft_step_op(monkeypatch) -> None:
    """Where the target runs the fused ops, ``auto`` drafts with one int4 copy whose chain steps
    and catch-ups run as one draft_step_ids op each, and every method still emits plain
    decoding's tokens."""
    import torch

    from evospec.decoding.sampling import SamplingParams
    from evospec.models.eagle import new_eagle_for
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import quantize_linears
    from tests.decoding.spec_helpers import ar_tokens, prompt_of

    if not kernels_available("int4"):
        pytest.skip("torch without CPU int4 kernels")
    target = tiny_target(3, head_dim=64)
    quantize_linears(target, "int4")
    if not enable_fused_ops(target) or target.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the fused draft step needs the op library and our int4 kernel (AVX-512 VNNI)")
    import evospec.decoding.drafter as drafter_module

    rows_run: list[int] = []  # rows of each draft_step_ids call
    run = drafter_module.run_fused_draft_ids
    monkeypatch.setattr(
        drafter_module,
        "run_fused_draft_ids",
        lambda h, f, t, *a: rows_run.append(t.shape[0]) or run(h, f, t, *a),
    )
    import evospec.vocab.head as head_module
    from evospec.decoding.tree import TreeConfig

    top1_calls: list[int] = []  # rows of each one-op top-1 (a greedy chain's steps on 4-bit slots)
    top1 = head_module._SlotTiles4.top1
    monkeypatch.setattr(
        head_module._SlotTiles4, "top1", lambda t, h, *a: top1_calls.append(h.shape[0]) or top1(t, h, *a)
    )
    draft = new_eagle_for(target, seed=2)
    decs = [
        make_decoder(n, target, draft=draft, vocab=SMALL, indices=stand_in_indices(target))
        for n in ("eagle2", "frspec", "nanospec")
    ]
    chain = TreeConfig(top_k=1, depth=3, total_tokens=3)  # the CPU's shapes: top-1 steps, host-built chains
    fr_chain = make_decoder(
        "frspec", target, draft=draft, vocab=SMALL, indices=stand_in_indices(target), tree=chain
    )
    int8 = make_decoder("eagle2", target, draft=draft, draft_weights="int8")
    int8_fr = make_decoder(
        "frspec", target, draft=draft, draft_weights="int8", vocab=SMALL, indices=stand_in_indices(target)
    )
    try:
        heads = [d.drafter.head for d in decs]
        assert heads[0] is heads[1] is heads[2] and heads[0].fused_step and not draft.fused_step
        assert _formats(heads[0]) == {"int4"} and _formats(int8.drafter.head) == {"int8"}
        # the int4 draft's reduced LM head projects 4-bit rows where its set is steady; a window that
        # changes every round, and an int8 draft, keep the target's codes
        tiles = [type(d.vocab.head.tiles).__name__ for d in (decs[1], decs[2], int8_fr)]
        assert tiles == ["_SlotTiles4", "_SlotTiles", "_SlotTiles"]
        params = SamplingParams(max_new_tokens=24)
        for seed, length in ((0, 6), (1, 7), (2, 40)):  # 40: a prompt catch-up past the recorded chains
            prompt = prompt_of(seed, length)
            want = ar_tokens(target, prompt, params)
            for dec in (*decs, int8, int8_fr, fr_chain):
                assert [t for ev in dec.generate(prompt, params) for t in ev.tokens] == want
        assert 40 in rows_run and 1 in rows_run  # the long prompt's catch-up as one op; rounds' steps
        assert top1_calls and set(top1_calls) == {1}  # only the int4 chain's steps took the one-op top-1
        # a catch-up of more pairs than a recorded chain holds, behind a filled cache: one op too
        drafter = decs[0].drafter
        drafter.start([1, 2, 3], 64)
        feats = torch.randn(25, target.cfg.hidden_size)
        drafter.catch_up(feats[:5], torch.arange(5))
        rows_run.clear()
        drafter.catch_up(feats[5:], torch.arange(20))
        assert rows_run == [20] and drafter.cache.length == 25
    finally:
        for d in (*decs, int8, int8_fr, fr_chain):
            d.close()


def test_auto_drafts_with_the_int8_copy_where_our_int4_kernel_is_off(monkeypatch) -> None:
    """``EVOSPEC_QUANT_KERNEL=torch`` (or a CPU without AVX-512 VNNI): no fused draft step, so
    ``auto`` resolves to int8 instead of failing, and ``int4`` asked for by name is a clear error."""
    from evospec.decoding.methods import draft_format
    from evospec.models.eagle import new_eagle_for
    from evospec.models.fused import enable_fused_ops
    from evospec.models.quant import quantize_linears

    if not (kernels_available("int4") and kernels_available("int8")):
        pytest.skip("torch without CPU int4/int8 kernels")
    target = tiny_target(3, head_dim=64)
    quantize_linears(target, "int4")
    if not enable_fused_ops(target):
        pytest.skip("no op library")
    draft = new_eagle_for(target, seed=2)
    monkeypatch.setenv("EVOSPEC_QUANT_KERNEL", "torch")
    assert draft_format(target, "auto", draft) == "int8"
    dec = make_decoder("eagle2", target, draft=draft)
    try:
        assert _formats(dec.drafter.head) == {"int8"}
    finally:
        dec.close()
    with pytest.raises(ValueError, match="int4 needs the fused CPU ops"):
        make_decoder("eagle2", target, draft=new_eagle_for(target, seed=4), draft_weights="int4")

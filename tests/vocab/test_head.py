"""The reduced head proposes only active ids, with the full head's ranking restricted to them."""

from __future__ import annotations

import pytest
import torch

from evospec.vocab.head import FREE, FullHead, ReducedHead


def _mask(ids, vocab=50):
    m = torch.zeros(vocab, dtype=torch.bool)
    m[list(ids)] = True
    return m


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(50, 8)


def test_topk_equals_full_logits_restricted_to_active(weight):
    head = ReducedHead(weight, capacity=12)
    active = [3, 7, 8, 20, 31, 44, 49]
    head.set_active(_mask(active))
    hidden = torch.randn(5, 8)
    logp, ids = head(hidden, 4)
    full = hidden @ weight.T  # [5, 50]
    ref = torch.log_softmax(full[:, active], dim=-1)  # renormalised over the active ids
    top = torch.topk(ref, 4, dim=-1)
    assert ids.tolist() == torch.tensor(active)[top.indices].tolist()
    torch.testing.assert_close(logp, top.values)


def test_only_new_rows_are_gathered_and_slots_map_to_ids(weight):
    head = ReducedHead(weight, capacity=6)
    assert head.set_active(_mask([1, 2, 3])) == 3
    assert head.set_active(_mask([2, 3, 4, 5])) == 2  # 1 leaves, 4 and 5 enter
    assert head.size == 4
    live = head.slot_ids[head.slot_ids != FREE]
    assert sorted(live.tolist()) == [2, 3, 4, 5]
    for tok in (2, 3, 4, 5):
        slot = int(head.slot_of[tok])
        assert int(head.slot_ids[slot]) == tok
        assert torch.equal(head.rows[slot], weight[tok])
    assert int(head.slot_of[1]) == FREE
    assert head.active_mask().nonzero().flatten().tolist() == [2, 3, 4, 5]


def test_free_slots_are_never_proposed(weight):
    head = ReducedHead(weight, capacity=10)
    head.set_active(_mask([5, 6]))
    logp, ids = head(torch.randn(3, 8), 4)  # asks for more than are active
    assert ids.shape == (3, 2) and set(ids.flatten().tolist()) <= {5, 6}
    assert torch.isfinite(logp).all()


def test_capacity_overflow_is_a_clear_error(weight):
    head = ReducedHead(weight, capacity=3)
    with pytest.raises(ValueError, match="exceeds the head capacity 3"):
        head.set_active(_mask([1, 2, 3, 4]))


def test_full_head_matches_plain_topk_and_times_itself(weight):
    head = FullHead(weight)
    hidden = torch.randn(2, 8)
    _, ids = head(hidden, 3)
    ref = torch.topk(torch.log_softmax(hidden @ weight.T, -1), 3, -1)
    assert torch.equal(ids, ref.indices)
    assert head.take_timings().lm_head_s > 0 and head.timings.lm_head_s == 0


def test_packed_buffer_matches_dense_and_repacks_only_rewritten_blocks(weight):
    packed = ReducedHead(weight, capacity=24, pack_min_rows=1, pack_block=8)  # 3 blocks of 8 slots
    dense = ReducedHead(weight, capacity=24, pack_min_rows=10**9)
    assert packed.packed is not None and dense.packed is None
    hidden = torch.randn(3, 8)
    sets = [range(0, 20), [*range(0, 18), 40, 41], [*range(0, 18), 40, 45, 46], range(30, 50)]
    repacked = []
    for active in sets:
        for head in (packed, dense):
            head.set_active(_mask(active))
        before = packed.packed.repacked_blocks
        (lp, ip), (ld, idd) = packed(hidden, 5), dense(hidden, 5)
        assert torch.equal(ip, idd) and torch.allclose(lp, ld, atol=1e-5)
        repacked.append(packed.packed.repacked_blocks - before)
    # first load packs all 3 blocks; 40, 41 land in free slots 18, 19 (block 2); 45, 46 reuse
    # slot 19 and take slot 20 (block 2); the last set rewrites slots in every block
    assert repacked == [3, 1, 1, 3]


def test_int8_rows_give_the_target_heads_int8_logits_and_gather_incrementally():
    """With an int8 LM head the buffer holds its codes and scales: logits over the active ids
    are exactly the full int8 head's there, and each set change copies only the new rows."""
    from evospec.models.quant import Int8Matmul, kernels_available

    if not kernels_available("int8"):
        pytest.skip("torch without CPU int8 kernels")
    torch.manual_seed(1)
    weight = torch.randn(300, 64)
    int8 = Int8Matmul(weight, None, [300])
    head = ReducedHead(weight, capacity=40, int8=int8)
    assert head.rows.dtype == torch.int8 and head.packed is None
    hidden = torch.randn(3, 64)
    full = int8(hidden).float()  # [3, 300]
    for active in ([5, 17, 80, 81, 299], [5, 80, 120, 121, 122, 200], list(range(260, 300))):
        before = head.timings.rows_gathered
        added = head.set_active(_mask(active, vocab=300))
        assert head.timings.rows_gathered - before == added
        logp, ids = head(hidden, 3)
        ref = torch.log_softmax(full[:, active], dim=-1)
        top = torch.topk(ref, 3, dim=-1)
        assert ids.tolist() == torch.tensor(active)[top.indices].tolist()
        torch.testing.assert_close(logp, top.values, rtol=0, atol=1e-6)
    assert head.set_active(_mask([260, 261], vocab=300)) == 0  # both already hold slots
    assert head.stage(_mask([1, 260], vocab=300)) == 1  # the staged path: the same host work
    assert sorted(head.active_mask().nonzero().flatten().tolist()) == [1, 260]


def test_int4_slots_give_each_id_its_own_4bit_rows_logits_through_set_changes():
    """An int4 draft's reduced head rounds its slots' int8 rows to 4-bit groups: each active id's
    logit is bitwise that of a head holding the id in another slot (a row's codes and its
    output depend on that row alone, whatever else shares its tile), close to the int8 head's,
    and a set change repacks only the tiles its new slots fall in."""
    from evospec.kernels.int4_matmul import vnni_available
    from evospec.models.quant import Int8Matmul

    if not vnni_available():
        pytest.skip("no int8-activation kernels (AVX2 or later) on this CPU")
    torch.manual_seed(3)
    weight = torch.randn(320, 64)
    int8 = Int8Matmul(weight, None, [320])
    head = ReducedHead(weight, capacity=40, int8=int8, int4=True)  # 3 tiles, the last one partly used
    exact = ReducedHead(weight, capacity=40, int8=int8)
    assert type(head.tiles).__name__ == "_SlotTiles4" and type(exact.tiles).__name__ == "_SlotTiles"
    hidden = torch.randn(3, 64)
    for active in ([5, 17, 80, 81, 319], [5, 80, 120, 121, 122, 200], list(range(280, 320))):
        before = head.tiles.packed.clone()
        head.set_active(_mask(active, vocab=320))
        exact.set_active(_mask(active, vocab=320))
        fresh = ReducedHead(weight, capacity=40, int8=int8, int4=True)
        fresh.set_active(_mask(active, vocab=320))  # slots in id order
        slots, fresh_slots = head.slot_of[torch.tensor(active)], fresh.slot_of[torch.tensor(active)]
        logits = head._project(hidden)  # [3, 40]
        assert logits.shape == (3, 40)
        assert torch.equal(logits[:, slots], fresh._project(hidden)[:, fresh_slots])
        ref = exact._project(hidden)[:, exact.slot_of[torch.tensor(active)]]
        assert (logits[:, slots] - ref).abs().max() < 0.1 * ref.abs().max()
        touched = torch.unique(head.slot_of[torch.tensor(active)] // 16)
        unchanged = [t for t in range(3) if t not in touched.tolist()]
        assert all(torch.equal(head.tiles.packed[t], before[t]) for t in unchanged)
        _, ids = head(hidden, 3)
        assert set(ids.flatten().tolist()) <= set(active)


def test_int8_slots_in_vnni_tiles_give_the_full_heads_logits_bit_for_bit():
    """Where the target's int8 head runs the VNNI kernel, the reduced head keeps its slots in
    that kernel's tiles: each active id's logit is bitwise the full head's, through set changes
    that rewrite single lanes of a tile, with a capacity that is not a whole number of tiles."""
    from evospec.kernels.int4_matmul import vnni_available
    from evospec.kernels.int8_matmul import unpack_int8
    from evospec.models.quant import Int8Matmul

    if not vnni_available():
        pytest.skip("no int8-activation kernels (AVX2 or later) on this CPU")
    torch.manual_seed(2)
    weight = torch.randn(320, 64)
    int8 = Int8Matmul(weight, None, [320])
    assert int8.kernel == "vnni"
    head = ReducedHead(weight, capacity=40, int8=int8)  # 3 tiles, the last one partly used
    assert head.tiles is not None
    hidden = torch.randn(3, 64)
    full = int8(hidden).float()  # [3, 320]
    for active in ([5, 17, 80, 81, 319], [5, 80, 120, 121, 122, 200], list(range(280, 320))):
        head.set_active(_mask(active, vocab=320))
        slots = head.slot_of[torch.tensor(active)]
        assert torch.equal(unpack_int8(head.tiles.packed)[slots], int8.codes[active])
        logits = head._project(hidden)  # [3, 40]
        assert logits.shape == (3, 40)
        assert torch.equal(logits[:, slots], full[:, active])
        _, ids = head(hidden, 3)
        top = torch.topk(torch.log_softmax(full[:, active], dim=-1), 3, dim=-1)
        assert ids.tolist() == torch.tensor(active)[top.indices].tolist()


def test_an_int4_heads_top1_is_one_op_with_the_projections_choice():
    """A greedy chain's step (k = 1, no chooser) on 4-bit slots takes its top-1 in one op: the
    id the projection, the log-softmax and a row max pick, its log-prob to float rounding;
    a free slot is never picked, and a set of one id picks it with log-prob 0."""
    from evospec.kernels.int4_matmul import vnni_available
    from evospec.models.quant import Int8Matmul

    if not vnni_available():
        pytest.skip("no int8-activation kernels (AVX2 or later) on this CPU")
    torch.manual_seed(4)
    weight = torch.randn(320, 64)
    head = ReducedHead(weight, capacity=40, int8=Int8Matmul(weight, None, [320]), int4=True)
    hidden = torch.randn(5, 64)
    for active in ([5, 17, 80, 81, 319], list(range(280, 320)), [42]):
        head.set_active(_mask(active, vocab=320))
        logp, ids = head(hidden, 1)
        ref = torch.log_softmax(head._project(hidden).float() + head.bias, dim=-1).max(dim=-1)
        assert ids.shape == logp.shape == (5, 1)
        assert torch.equal(ids[:, 0], head.slot_ids[ref.indices])
        torch.testing.assert_close(logp[:, 0], ref.values, atol=1e-5, rtol=1e-5)
        assert set(ids.flatten().tolist()) <= set(active)
    assert torch.equal(logp, torch.zeros(5, 1))  # one active id: certain

"""Vocabulary policies: what each makes active, and that every one of them is lossless."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from evospec.decoding.methods import make_decoder
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from evospec.vocab.factory import POLICIES, VocabConfig, make_policy, static_table
from evospec.vocab.policy import NanoSpecConfig, NanoSpecVocab, RoundFeedback, frspec_size
from tests.decoding.spec_helpers import (
    ar_tokens,
    chi2_pvalue,
    exact_second_token,
    prompt_of,
    sampled_second_tokens,
    tiny_target,
)
from tests.vocab.helpers import SMALL, stand_in_indices

V = 64


def bundle(target, counts=None):
    return stand_in_indices(target, counts)


def test_frspec_size_rule():
    assert frspec_size(151_936) == 32768 and frspec_size(262_144) == 32768
    assert frspec_size(49_152) == 12_288  # V / 4 below 128k
    assert frspec_size(64) == 64


def test_static_table_is_topk_by_count_ties_to_lower_id():
    counts = np.array([5, 9, 9, 1, 9, 0])
    assert static_table(counts, 3).tolist() == [1, 2, 4]
    assert static_table(counts, 4).tolist() == [0, 1, 2, 4]


def _feedback(tree, verified, logits, round_index=0, oov=False, dim=32):
    return RoundFeedback(
        tree_tokens=torch.tensor(tree),
        verified=torch.tensor(verified),
        path_logits=logits,
        bonus_hidden=torch.zeros(dim),
        oov=oov,
        round_index=round_index,
    )


def test_nanospec_stream_by_hand():
    pol = NanoSpecVocab(10, NanoSpecConfig(k_pre=1, k_ver=1, w_max=6))
    pol.start(torch.tensor([1, 2, 2]), torch.tensor([[3], [4], [1]]))  # stream 1 2 2 3 4 1
    assert pol.active_mask(0).nonzero().flatten().tolist() == [1, 2, 3, 4]
    logits = torch.zeros(2, 10)
    logits[0, 8] = logits[1, 9] = 1.0  # top-1 of the two path rows: 8, 9
    pol.observe(_feedback([1, 5, 5, 6], [5, 9], logits))  # draft uniques 5 6, then 8 9
    # stream ... 2 3 4 1 | 5 6 8 9 -> last 6: 4 1 5 6 8 9
    assert pol.active_mask(1).nonzero().flatten().tolist() == [1, 4, 5, 6, 8, 9]


def test_evospec_oov_event_admits_retrieved_ids_next_round(target):
    pol = make_policy("evospec", V, cfg=SMALL, indices=bundle(target))
    pol.start(torch.tensor([1, 2]), None)
    core = pol.active_mask(0).clone()
    assert core.nonzero().flatten().tolist() == list(range(16))  # the 16 most frequent ids
    logits = torch.zeros(1, V)
    logits[0, [40, 41, 42]] = torch.tensor([3.0, 2.0, 1.0])
    pol.observe(_feedback([0, 5], [40], logits, oov=True))
    active = pol.active_mask(1)
    dyn = (active & ~core).nonzero().flatten().tolist()
    assert 40 in dyn and len(dyn) <= SMALL.arc_max_insert
    assert torch.equal(active & core, core)  # the core never leaves
    stats = pol.take_stats()
    assert stats.admitted == len(dyn) and len(stats.retrieval_s) == 1 and stats.late == 0


def test_core_k_sizes_evospec_core_apart_from_the_frspec_table(target):
    cfg = replace(SMALL, core_k=8)
    evo = make_policy("evospec", V, cfg=cfg, indices=bundle(target))
    fr = make_policy("frspec", V, cfg=cfg, indices=bundle(target))
    evo.start(torch.tensor([1, 2]), None)
    fr.start(torch.tensor([1, 2]), None)
    assert evo.active_mask(0).nonzero().flatten().tolist() == list(range(8))  # the 8 most frequent
    assert int(fr.active_mask(0).sum()) == SMALL.frspec_k  # frspec keeps its own 16
    with pytest.raises(ValueError, match="core_k must be >= 1"):
        replace(SMALL, core_k=0)


PROMPTS = [prompt_of(s, 4 + 3 * s) for s in range(4)]
TREES = (TreeConfig(top_k=4, depth=4, total_tokens=12), TreeConfig(top_k=2, depth=3, total_tokens=5))


@pytest.mark.parametrize("tree", TREES, ids=["k4d4t12", "k2d3t5"])
@pytest.mark.parametrize("method", POLICIES)
def test_greedy_output_equals_ar_under_every_policy(target, head, method, tree):
    dec = make_decoder(
        method, target, draft=head, tree=tree, vocab=SMALL, indices=bundle(target), eos_ids=(V - 1,)
    )
    params = SamplingParams(max_new_tokens=30)
    oov_rounds = 0
    # a per-step head (specvocab) has its capacity per draft row; the round's set is their union
    bound = dec.vocab.head.capacity * (tree.depth * tree.top_k if dec.vocab.per_step else 1)
    for prompt in PROMPTS:
        events = list(dec.generate(prompt, params))
        assert [t for ev in events for t in ev.tokens] == ar_tokens(target, prompt, params, eos=(V - 1,))
        rounds = [ev.vocab for ev in events if not ev.prefill]
        assert all(r is not None and r.active_size <= bound for r in rounds)
        assert all(r.covered >= r.verified - 1 for r in rounds)  # accepted tokens are always active
        oov_rounds += sum(r.oov for r in rounds)
    assert oov_rounds > 0  # the small vocabularies really miss tokens here


@pytest.mark.parametrize("method", ["frspec", "evospec", "nanospec"])
def test_reduced_head_on_the_int8_kernels_tiles_stays_lossless(head, method):
    """A quantised target (int4 linears, int8 head on our VNNI kernel): the reduced head keeps
    its slots in that kernel's tiles, rewritten as the active set moves; greedy output stays AR's."""
    from evospec.kernels.int4_matmul import vnni_available
    from evospec.models.quant import quantize_linears

    if not vnni_available():
        pytest.skip("no int8-activation kernels (AVX2 or later) on this CPU")
    target = tiny_target(0)
    quantize_linears(target, "int4")
    target.exact_rows = True
    dec = make_decoder(
        method, target, draft=head, tree=TREES[0], vocab=SMALL, indices=bundle(target), eos_ids=(V - 1,)
    )
    assert dec.vocab.head.tiles is not None
    params = SamplingParams(max_new_tokens=30)
    for prompt in PROMPTS:
        events = list(dec.generate(prompt, params))
        assert [t for ev in events for t in ev.tokens] == ar_tokens(target, prompt, params, eos=(V - 1,))


@pytest.mark.parametrize("method", ["frspec", "evospec"])
def test_block_packed_reduced_head_stays_lossless(target, head, method, monkeypatch):
    """The CPU's oneDNN-packed head buffer (``PackedRows``; real sizes only) on tiny blocks."""
    import evospec.vocab.head as head_mod

    monkeypatch.setattr(head_mod, "PACK_MIN_ROWS", 1)
    monkeypatch.setattr(head_mod, "PACK_BLOCK", 4)
    dec = make_decoder(
        method, target, draft=head, tree=TREES[0], vocab=SMALL, indices=bundle(target), eos_ids=(V - 1,)
    )
    assert dec.vocab.head.packed is not None
    params = SamplingParams(max_new_tokens=30)
    for prompt in PROMPTS:
        out = [t for ev in dec.generate(prompt, params) for t in ev.tokens]
        assert out == ar_tokens(target, prompt, params, eos=(V - 1,))
    assert dec.vocab.head.packed.repacked_blocks > 0


@pytest.mark.parametrize("method", POLICIES)
def test_the_path_logits_are_gathered_only_for_a_policy_that_reads_them(target, head, method, monkeypatch):
    """frspec's table and the full head learn nothing from a round: their rounds skip gathering the
    path's [a + 1, V] logits (coverage and OOV come from the verified ids); every other policy
    gets them each round."""
    from evospec.vocab.active import ActiveVocab

    dec = make_decoder(
        method, target, draft=head, tree=TREES[1], vocab=SMALL, indices=bundle(target), eos_ids=(V - 1,)
    )
    handed = []
    end_round = ActiveVocab.end_round

    def spy(self, tree_tokens, path, verified, path_logits, hidden):
        handed.append(path_logits is not None and tuple(path_logits.shape) == (path.numel(), V))
        return end_round(self, tree_tokens, path, verified, path_logits, hidden)

    monkeypatch.setattr(ActiveVocab, "end_round", spy)
    params = SamplingParams(max_new_tokens=16)
    assert [t for ev in dec.generate(PROMPTS[0], params) for t in ev.tokens] == ar_tokens(
        target, PROMPTS[0], params, eos=(V - 1,)
    )
    assert handed and set(handed) == {method not in ("frspec", "vocabtrim")}
    assert dec.vocab.observes == (method not in ("frspec", "vocabtrim"))


def test_eagle2_reports_full_coverage(target, head):
    dec = make_decoder("eagle2", target, draft=head, tree=TREES[0])
    evs = [ev for ev in dec.generate(PROMPTS[1], SamplingParams(max_new_tokens=12)) if not ev.prefill]
    assert all(ev.vocab.covered == ev.vocab.verified and ev.vocab.active_size == V for ev in evs)


def test_sampled_output_repeats_under_a_seed(target, head):
    dec = make_decoder("nanospec", target, draft=head, tree=TREES[0], vocab=SMALL)
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5)
    runs = [[t for ev in dec.generate(PROMPTS[2], params) for t in ev.tokens] for _ in range(2)]
    assert runs[0] == runs[1]


class _Failing:
    """A retrieval index that raises, or blocks until released."""

    def __init__(self, stall: bool) -> None:
        self.stall = stall
        self.gate = threading.Event()

    def search(self, h, k):
        if self.stall:
            self.gate.wait(10)
            return np.zeros((1, k), dtype=np.int64)
        raise RuntimeError("corrupt index")


@pytest.mark.parametrize("stall", [False, True], ids=["raises", "stalls"])
def test_failing_retrieval_leaves_output_unchanged_and_is_reported(target, head, stall):
    broken = _Failing(stall)
    indices = SimpleNamespace(counts=np.arange(V)[::-1].copy(), hnsw=broken, graph=None)
    cfg = VocabConfig(**{**SMALL.__dict__, "synchronous": False, "max_pending": 1})
    dec = make_decoder("evospec", target, draft=head, tree=TREES[0], vocab=cfg, indices=indices)
    params = SamplingParams(max_new_tokens=40)
    prompt = PROMPTS[3]
    events = list(dec.generate(prompt, params))
    broken.gate.set()
    assert [t for ev in events for t in ev.tokens] == ar_tokens(target, prompt, params)
    rounds = [ev.vocab for ev in events if not ev.prefill]
    assert sum(r.oov for r in rounds) >= 2
    if stall:
        assert sum(r.dropped for r in rounds) >= 1  # saturated pool: later events are dropped
    else:
        assert sum(r.errors for r in rounds) >= 1
    assert all(not r.retrieval_s for r in rounds)  # nothing was merged
    dec.vocab.close()


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """A tiny target and an EAGLE-2 head trained on its answers, so sampled drafts get accepted."""
    from evospec.models.eagle import new_eagle_for
    from evospec.train.trainer import TrainConfig, train_head
    from tests.train.test_trainer import make_sequences

    flat = tiny_target(0, sharp=4.0)
    trained = new_eagle_for(flat)
    for p in trained.parameters():
        p.requires_grad_(True)
    cfg = TrainConfig(epochs=6, lr=3e-3, warmup_steps=2, tokens_per_batch=256, holdout=0.2, noise=0.05)
    train_head(
        trained, flat, make_sequences(flat), tmp_path_factory.mktemp("head") / "ckpt", cfg, progress=False
    )
    for p in trained.parameters():
        p.requires_grad_(False)
    return flat, trained


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "drawn-chain"])
@pytest.mark.parametrize("method", POLICIES)
def test_sampled_tokens_follow_the_target_at_t07_under_every_policy(sampling_pair, method, chain):
    """EvoSpec's Table 8 setting: at T=0.7 the second generated token (drafted from the policy's
    vocabulary, accepted or resampled) has the target's marginal; a chain draws its tokens from
    the draft's distribution over the policy's slots (free slots, ids -1, hold no mass) and the
    ratio test divides by that distribution mapped back to target ids."""
    target, head = sampling_pair
    roomy = replace(SMALL, frspec_k=40, w_max=40, cluster_budget=40, candidates=32)  # most drafts in reach
    tree = TreeConfig(top_k=1, depth=3, total_tokens=3) if chain else TREES[1]
    dec = make_decoder(method, target, draft=head, tree=tree, vocab=roomy, indices=bundle(target))
    prompt = prompt_of(100, 6)  # a training prompt: the head knows its continuation
    exact = exact_second_token(target, prompt, temperature=0.7).float()
    counts, accepted = sampled_second_tokens(dec, prompt, 0.7, n=600)
    assert accepted > 0  # drafts from the reduced vocabulary are accepted (the heavy-acceptance law of
    # the shared verifier is tested in tests/decoding/test_speculative.py)
    assert chi2_pvalue(counts, exact) > 1e-3


def test_a_static_table_is_loaded_into_the_head_once_and_a_changed_mask_again():
    """A policy that returns the same, unmodified mask every round (FR-Spec's table) costs the
    reduced head no per-round merge or slot diff; editing that mask in place, or returning
    another, loads it again."""
    from evospec.vocab.active import ActiveVocab
    from evospec.vocab.policy import StaticVocab

    torch.manual_seed(0)
    weight = torch.randn(100, 16)
    policy = StaticVocab([1, 5, 9, 40], 100)
    active = ActiveVocab(policy, weight, always_ids=[99])
    loads = []
    original = active.head.set_active

    def recording(mask):
        loads.append(sorted(mask.nonzero().flatten().tolist()))
        return original(mask)

    active.head.set_active = recording
    hidden = torch.randn(1, 16)
    for _ in range(3):
        active.begin_round()
        _, ids = active.draft_head(hidden, 5)
        assert set(ids.flatten().tolist()) == {1, 5, 9, 40, 99}
    assert loads == [[1, 5, 9, 40, 99]]
    policy.mask[7], policy.mask[40] = True, False  # edited in place: its version moves
    active.begin_round()
    _, ids = active.draft_head(hidden, 5)
    assert loads[-1] == [1, 5, 7, 9, 99] and set(ids.flatten().tolist()) == {1, 5, 7, 9, 99}
    policy.mask = torch.zeros(100, dtype=torch.bool)  # another mask
    policy.mask[[2, 3]] = True
    active.begin_round()
    active.draft_head(hidden, 2)
    assert loads[-1] == [2, 3, 99] and len(loads) == 3

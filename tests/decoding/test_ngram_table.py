"""The model's n-gram table: counting, guessing, its file, and rounds that verify its guesses."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evospec.decoding.lookup import LookupDraft
from evospec.decoding.methods import make_decoder
from evospec.decoding.ngram_table import NgramTable, context_keys, load_ngram_table
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import (
    VOCAB,
    ar_tokens,
    chi2_pvalue,
    eagle_drafter,
    exact_second_token,
    perturbed_drafter,
    prompt_of,
    sampled_second_tokens,
    tiny_target,
)
from tests.decoding.test_speculative import _quantised_target


def _table(seqs, **kw) -> NgramTable:
    return NgramTable.count(seqs, model="tiny", vocab_size=kw.pop("vocab_size", 100), **kw)


def test_the_longest_context_held_guesses_with_its_share():
    # "1 2" is followed by 3 twice and by 4 twice (a tie: the first seen wins); "7 1 2" always by 4
    table = _table([[1, 2, 3], [1, 2, 3], [7, 1, 2, 4], [7, 1, 2, 4]], min_count=2)
    assert table.guess([9, 1, 2]) == (3, pytest.approx(0.5, abs=1e-3))  # "9 1 2" unseen: "1 2" answers
    assert table.guess([7, 1, 2]) == (4, 1.0)  # the longer context wins
    assert table.guess([5]) is None  # never seen
    assert table.guess([3]) is None  # seen, but never followed by anything


def test_contexts_below_min_count_are_left_out_and_low_shares_do_not_propose():
    table = _table([[1, 2, 3], [1, 2, 4], [1, 5]], min_count=2, min_share=0.5)
    assert table.guess([8, 2]) == (3, 0.5)  # "8 2" was never seen: the 1-gram "2" answers
    assert table.guess([5]) is None  # "5" was seen once: left out
    assert table.propose([2], 3) == [3]  # share 0.5 >= 0.5; then "2 3" and "3": nothing follows
    strict = _table([[1, 2, 3], [1, 2, 4], [1, 5]], min_count=2, min_share=0.6)
    assert strict.propose([2], 3) == []
    assert strict.guess([1]) == (2, pytest.approx(2 / 3, abs=1e-3))
    assert strict.propose([1], 3) == [2]  # then "1 2": 3 or 4, share 0.5 < 0.6


def test_serving_picks_its_own_share_threshold():
    """``propose``'s ``min_share`` (serving's ``TreeConfig.table_min_share``) replaces the build's
    threshold; a round's lookup passes the tree's, 0.12 by default."""
    table = _table([[1, 2, 3], [1, 2, 4], [1, 2, 5], [1, 2, 5]], min_count=2, min_share=0.6)
    assert table.guess([2]) == (5, 0.5)
    assert table.propose([2], 1) == []  # the build's 0.6
    assert table.propose([2], 1, 0.5) == [5]
    assert table.propose([2], 1, 0.51) == []
    one = TreeConfig(top_k=1, depth=1, total_tokens=1, table_lookup=1)
    draft = LookupDraft(one, table)
    draft.reset([7, 2])
    assert draft.propose() == [5]  # the default 0.3
    strict = LookupDraft(replace(one, table_min_share=0.6), table)
    strict.reset([7, 2])
    assert strict.propose() == []
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="table_min_share"):
            TreeConfig(table_min_share=bad)


def test_propose_chains_guesses_up_to_k():
    table = _table([[1, 2, 3, 4, 5, 6]] * 2, min_count=2, max_order=2)
    assert table.propose([9, 1], 4) == [2, 3, 4, 5]
    assert table.propose([9, 1], 1) == [2]
    assert table.propose([6], 4) == []
    assert context_keys([1, 2, 3], 2) == context_keys([0, 2, 3], 2)  # only the last 2 count


def test_counting_checks_ids_and_settings():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _table([[1, 200]])
    with pytest.raises(ValueError, match="min_share"):
        _table([[1, 2]], min_share=0.0)


def test_the_file_round_trips_and_is_checked(tmp_path):
    table = _table([[1, 2, 3], [1, 2, 3], [4, 1, 2]], min_count=1, source="unit test")
    path = tmp_path / "t.safetensors"
    table.save(path)
    back = load_ngram_table(path, vocab_size=100)
    assert back.info == table.info and len(back) == len(table)
    assert torch.equal(back.keys, table.keys) and torch.equal(back.next_ids, table.next_ids)
    assert torch.equal(back.shares, table.shares)
    assert back.guess([1, 2]) == table.guess([1, 2])
    with pytest.raises(ValueError, match=r"vocab_size 100 \(built for tiny\) does not match .* 50"):
        load_ngram_table(path, vocab_size=50)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_ngram_table(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError, match=r"is a folder; name the table's \.safetensors file"):
        load_ngram_table(tmp_path)
    from safetensors.torch import save_file

    bad = {"keys": table.keys, "next_ids": table.next_ids + 100, "shares": table.shares}  # ids >= 100
    save_file(bad, str(tmp_path / "bad.safetensors"), metadata=dict(table_metadata(path)))
    with pytest.raises(ValueError, match="next_ids outside"):
        load_ngram_table(tmp_path / "bad.safetensors", vocab_size=100)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not an n-gram table"):
        load_ngram_table(junk)


def table_metadata(path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_context_lookup_comes_first_then_the_table():
    table = _table([[1, 2, 7, 8]] * 2, min_count=2)
    draft = LookupDraft(TreeConfig(lookup=3, lookup_ngram=2, table_lookup=2), table)
    draft.reset([5, 6, 9, 5, 6])  # "5 6" occurred before: the context proposes what followed
    assert draft.propose() == [9, 5]
    draft.reset([3, 1])  # nothing repeats: the table guesses after "1"
    assert draft.propose() == [2, 7]
    draft.extend([2])
    assert draft.propose() == [7, 8]
    only_table = LookupDraft(TreeConfig(table_lookup=1), table)
    only_table.reset([5, 6, 9, 5, 6, 1])
    assert only_table.context is None and only_table.propose() == [2]
    assert not LookupDraft(TreeConfig(), table).active  # both off: drafted rounds only
    with pytest.raises(ValueError, match="n-gram table"):
        LookupDraft(TreeConfig(table_lookup=1), None)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


def _own_table(target, n_prompts: int = 12) -> NgramTable:
    """A table of the target's own greedy answers to other prompts, as ``build-ngrams`` counts."""
    params = SamplingParams(max_new_tokens=40)
    seqs = [ar_tokens(target, prompt_of(500 + i, 6), params) for i in range(n_prompts)]
    return NgramTable.count(seqs, model="tiny", vocab_size=VOCAB, min_count=1, min_share=0.3)


@pytest.fixture(scope="module")
def table(target):
    return _own_table(target)


TABLE1 = TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=3, table_lookup=1)
TABLE_ONLY = TreeConfig(top_k=1, depth=2, total_tokens=2, table_lookup=2)
TREE = TreeConfig(top_k=3, depth=2, total_tokens=5, lookup=2, table_lookup=2)


@pytest.mark.parametrize("tree", [TABLE1, TABLE_ONLY, TREE], ids=["chain1+lookup3+table1", "table2", "tree"])
@pytest.mark.parametrize("drafter", ["eagle-random", "perturbed", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_with_the_table_equals_ar(target, table, drafter, tree, seed):
    """Table rounds, lookup rounds and drafted rounds between them give plain decoding's tokens."""
    drafters = {
        "eagle-random": lambda: eagle_drafter(target, seed=seed),
        "perturbed": lambda: perturbed_drafter(target, noise=0.6, seed=seed),
        "none": lambda: None,
    }
    prompt = prompt_of(seed, 8)
    params = SamplingParams(max_new_tokens=32)
    evs = [*generate(target, drafters[drafter](), prompt, params, tree, table)]
    assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)
    assert any(ev.looked_up and ev.tree_size > 0 for ev in evs if not ev.prefill)


def generate(target, drafter, prompt, params, tree, table):
    from evospec.decoding.speculative import generate_speculative

    return generate_speculative(target, drafter, prompt, params, tree, ngrams=table)


def test_the_table_guesses_what_the_target_writes(target, table):
    """On new prompts, the table of the target's own answers proposes in most rounds and is
    often right (a random target's greedy text is repetitive)."""
    proposed = accepted = 0
    for seed in range(6):
        for ev in generate(
            target, None, prompt_of(seed, 8), SamplingParams(max_new_tokens=40), TABLE_ONLY, table
        ):
            if not ev.prefill:
                proposed += ev.tree_size
                accepted += ev.accepted
    assert proposed > 0 and accepted > 0.2 * proposed


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_greedy_with_the_table_equals_ar_on_a_quantised_target(fmt):
    """Table rounds of every length verify through recorded chain graphs, bitwise as AR."""
    target = _quantised_target(6, fmt)
    table = _own_table(target, 6)
    params = SamplingParams(max_new_tokens=32)
    for seed in range(2):
        prompt = prompt_of(seed, 8)
        evs = list(
            generate(
                target,
                None,
                prompt,
                params,
                TreeConfig(top_k=1, depth=1, total_tokens=1, table_lookup=3),
                table,
            )
        )
        assert [t for ev in evs for t in ev.tokens] == ar_tokens(target, prompt, params)


def test_the_ngram_method_reads_the_table_and_samples_the_target_law():
    """``ngram`` with a table verifies its guesses by default (table_lookup 1); at T=1 its second
    token still follows the target's law."""
    target = tiny_target(4, sharp=3.0)
    table = _own_table(target)
    dec = make_decoder("ngram", target, ngrams=table)
    assert dec.tree.table_lookup == 1 and dec.ngrams is table
    assert make_decoder("ngram", target).tree.table_lookup == 0  # no table: lookup alone
    prompt = prompt_of(8, 10)
    exact = exact_second_token(target, prompt, temperature=1.0).float()
    counts, accepted = sampled_second_tokens(dec, prompt, 1.0, 1500)
    assert accepted > 100  # the table's guesses, accepted or resampled as the target law says
    assert chi2_pvalue(counts, exact) > 1e-3


def test_table_lookup_without_a_table_is_refused(target):
    with pytest.raises(ValueError, match="needs the model's n-gram table"):
        make_decoder("ngram", target, tree=TreeConfig(table_lookup=1))
    with pytest.raises(ValueError, match=r"tree\.table_lookup must be an integer >= 0"):
        TreeConfig(table_lookup=-1)
    assert TreeConfig(top_k=1, depth=1, total_tokens=1, lookup=2, table_lookup=4).max_nodes == 5


def test_a_perfect_draft_still_accepts_everything_after_table_rounds(target):
    """Table rounds defer the drafter's catch-up like lookup rounds: a target drafting for
    itself proposes its own greedy tokens only if every pair verified since was committed."""
    from evospec.decoding.drafter import TargetDrafter

    tree = TreeConfig(top_k=1, depth=2, total_tokens=2, table_lookup=1)
    table = _own_table(target, 2)  # a small table: it has no guess in some rounds
    drafted = looked = 0
    for seed in range(4):
        evs = list(
            generate(
                target,
                TargetDrafter(target),
                prompt_of(seed, 8),
                SamplingParams(max_new_tokens=40),
                tree,
                table,
            )
        )
        for ev in evs[1:]:
            if ev.looked_up:
                looked += 1
            else:
                drafted += 1
                assert ev.accepted == ev.tree_size == 2
    assert drafted > 0 and looked > 0


def test_a_table_of_longer_contexts_sees_them():
    """A table counted with max_order 6 gets the last 6 tokens from the round's proposer."""
    seqs = [[1, 2, 3, 4, 5, 6, 7]] * 2 + [[9, 2, 3, 4, 5, 6, 8]] * 3  # "2..6" -> 8 more often
    table = _table(seqs, max_order=6, min_count=2)
    assert table.guess([1, 2, 3, 4, 5, 6]) == (7, 1.0)  # only the 6-token context tells them apart
    draft = LookupDraft(TreeConfig(table_lookup=1), table)
    draft.reset([1, 2, 3, 4, 5, 6])
    assert draft.propose() == [7]

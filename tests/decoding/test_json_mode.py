"""JSON mode in every loop: plain steps, verified draft nodes (each with its own path's grammar
state), sampled verification and batch members pick from the same masked rows, so the output
is a JSON object's prefix and the same whichever method generates it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from evospec.decoding.drafter import TargetDrafter
from evospec.decoding.json_grammar import DONE, JsonGrammar, TokenTable
from evospec.decoding.penalties import Generated, Penalties, adjusted
from evospec.decoding.sampling import SamplingParams, greedy_ids, target_probs
from evospec.decoding.tree import TreeConfig
from tests.decoding.spec_helpers import (
    VOCAB,
    ar_tokens,
    chi2_pvalue,
    perturbed_drafter,
    prompt_of,
    spec_events,
    tiny_target,
)
from tests.decoding.test_json_grammar import PIECES, walk

EOS = VOCAB - 1
# the grammar test's pieces, single letters up to the tiny vocabulary, then EOS
TOKENS = [*PIECES, *(bytes([c]) for c in b"cdghijklmopqrsvwz")][: VOCAB - 1]
TREE = TreeConfig(top_k=3, depth=3, total_tokens=8)
CHAIN = TreeConfig(top_k=1, depth=3, total_tokens=3)


@pytest.fixture(scope="module")
def grammar() -> JsonGrammar:
    assert len(TOKENS) == VOCAB - 1
    return JsonGrammar(TokenTable(TOKENS, [EOS], VOCAB))


@pytest.fixture(scope="module")
def target():
    return tiny_target(5, eos=(EOS,))


def _text(tokens: list[int]) -> bytes:
    return b"".join(TOKENS[t] or b"<special>" for t in tokens if t != EOS)


def _params(grammar, **kw) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=kw.pop("max_new_tokens", 40), penalties=Penalties(grammar=grammar), **kw
    )


def test_plain_decoding_picks_the_best_allowed_token_and_ends_once_the_object_closes(target, grammar):
    closed = 0
    for seed in range(6):
        prompt = prompt_of(seed, 6)
        free = ar_tokens(target, prompt, SamplingParams(max_new_tokens=40), eos=(EOS,))
        tokens = ar_tokens(target, prompt, _params(grammar), eos=(EOS,))
        assert walk(_text(free)) is None  # the model alone writes no JSON
        state = walk(_text(tokens))
        assert state is not None
        if tokens[-1] == EOS:
            assert state.mode == DONE and EOS not in tokens[:-1]
            closed += 1
        ids = [*prompt, *tokens]
        logits = target(
            torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(len(ids)), logits="all"
        ).logits[0]
        for i, tok in enumerate(tokens):
            row = adjusted(
                logits[len(prompt) - 1 + i],
                Penalties(grammar=grammar),
                Generated(tokens[:i], grammar=grammar),
            )
            assert int(greedy_ids(row)) == tok
    assert closed  # some objects were finished


@pytest.mark.parametrize("tree", [TREE, CHAIN], ids=["tree", "chain"])
@pytest.mark.parametrize("prefetch", [None, 0.5], ids=["all-rows", "lazy-rows"])
@pytest.mark.parametrize("drafter", ["perfect", "perturbed", "lookup"])
def test_speculative_greedy_in_json_mode_equals_plain_decoding(target, grammar, tree, prefetch, drafter):
    """The drafts propose unconstrained tokens; each node is judged in its own path's state."""
    cfg = replace(tree, lookup=2) if drafter == "lookup" else tree
    drafters = {"perfect": TargetDrafter(target), "perturbed": perturbed_drafter(target, 0.6), "lookup": None}
    accepted = 0
    for seed in range(3):
        prompt = prompt_of(seed, 6)
        params = _params(grammar, max_new_tokens=30)
        events = spec_events(target, drafters[drafter], [*prompt, *prompt], params, cfg, (EOS,), prefetch)
        assert [t for ev in events for t in ev.tokens] == ar_tokens(
            target, [*prompt, *prompt], params, (EOS,)
        )
        accepted += sum(ev.accepted for ev in events)
    if drafter == "perfect":
        assert accepted


def test_drafted_json_paths_are_judged_in_their_own_order(target, grammar):
    """Context lookup drafting a JSON text the context holds: paths of several drafted tokens
    are accepted, each node in the state its path leads to (read in order)."""
    for seed in range(4):
        prompt = prompt_of(seed, 6)
        params = _params(grammar, max_new_tokens=30)
        first = ar_tokens(target, prompt, params, (EOS,))
        ids = [*prompt, *first, *prompt]
        events = spec_events(target, None, ids, params, replace(CHAIN, lookup=3), (EOS,))
        assert [t for ev in events for t in ev.tokens] == ar_tokens(target, ids, params, (EOS,))
        assert max(ev.accepted for ev in events) >= 2


def second_token_law(target, grammar: JsonGrammar, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V] the exact law of the second token sampled under ``grammar``: the sum over first
    tokens x of p(x) times the law under the mask of the state x leads to."""
    penalties = params.penalties

    def probs(ids: list[int], generated: list[int]) -> torch.Tensor:
        logits = target(
            torch.tensor([ids]), torch.arange(len(ids)), target.new_cache(len(ids)), logits="last"
        ).logits
        row = adjusted(logits[0, -1], penalties, Generated(generated, grammar=grammar))
        return target_probs(row, params).double()

    p1 = probs(prompt, [])
    return sum(p1[x] * probs([*prompt, x], [x]) for x in range(VOCAB) if p1[x] > 1e-7).float()


def test_sampled_json_mode_follows_the_masked_distribution(grammar):
    """The second token's law under the mask of the state the first token leads to, against
    drafted chains verified by the ratio test (a verification that judged the second token in
    the first one's state would put mass where this law has none)."""
    sharp = tiny_target(4, sharp=1.0, eos=(EOS,))
    prompt = prompt_of(8, 5)
    params = SamplingParams(max_new_tokens=2, temperature=1.0, penalties=Penalties(grammar=grammar))
    exact = second_token_law(sharp, grammar, prompt, params)
    n, counts, accepted = 1500, torch.zeros(VOCAB), 0
    drafter = perturbed_drafter(sharp, noise=0.3)
    for s in range(n):
        evs = spec_events(sharp, drafter, prompt, replace(params, seed=s), CHAIN, (EOS,))
        x1, x2 = [t for ev in evs for t in ev.tokens]
        assert walk(TOKENS[x1] + TOKENS[x2]) is not None
        counts[x2] += 1
        accepted += sum(ev.accepted for ev in evs)
    assert accepted > n // 10
    assert chi2_pvalue(counts, exact) > 1e-3

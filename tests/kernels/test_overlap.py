"""The staged (overlapped) vocabulary path drafts from the same sets as the inline one.

On a CPU ``ActiveVocab(overlap=True)`` runs the GPU path's logic inline: the next round's set
is taken from the policy at the accept boundary and staged into the head with fixed-shape
planning. For policies whose set only changes when they observe a round (NanoSpec, FR-Spec)
every round must draft from the same set, gather the same rows and emit the same tokens.
"""

from __future__ import annotations

import pytest

from evospec.decoding.drafter import EagleDrafter
from evospec.decoding.sampling import SamplingParams
from evospec.decoding.speculative import generate_speculative
from evospec.decoding.tree import TreeConfig
from evospec.models.eagle import new_eagle_for
from evospec.vocab.active import ActiveVocab
from evospec.vocab.factory import make_policy
from tests.decoding.spec_helpers import ar_tokens, prompt_of
from tests.vocab.helpers import SMALL, stand_in_indices

EOS = 63


def _run(target, method: str, overlap: bool, prompts: list[list[int]]):
    policy = make_policy(method, target.cfg.vocab_size, cfg=SMALL, indices=stand_in_indices(target))
    vocab = ActiveVocab(policy, target.lm_head.weight, always_ids=(EOS,), overlap=overlap)
    drafter = EagleDrafter(new_eagle_for(target, seed=1).attach(target), vocab.draft_head)
    tree = TreeConfig(top_k=4, depth=4, total_tokens=12)
    params = SamplingParams(max_new_tokens=24)
    runs = []
    for prompt in prompts:
        events = list(
            generate_speculative(target, drafter, prompt, params, tree, eos_ids=(EOS,), vocab=vocab)
        )
        runs.append(events)
    return vocab, runs, params


@pytest.mark.parametrize("method", ["nanospec", "frspec"])
def test_staged_sets_equal_inline_sets(target, method: str) -> None:
    prompts = [prompt_of(s, 5 + 4 * s) for s in range(3)]
    inline_vocab, inline, params = _run(target, method, False, prompts)
    staged_vocab, staged, _ = _run(target, method, True, prompts)
    assert not inline_vocab.overlap and staged_vocab.overlap
    for prompt, a, b in zip(prompts, inline, staged, strict=True):
        tokens = [t for ev in b for t in ev.tokens]
        assert tokens == [t for ev in a for t in ev.tokens] == ar_tokens(target, prompt, params, eos=(EOS,))
        ra = [(ev.accepted, ev.vocab.active_size, ev.vocab.covered, ev.vocab.oov) for ev in a if ev.vocab]
        rb = [(ev.accepted, ev.vocab.active_size, ev.vocab.covered, ev.vocab.oov) for ev in b if ev.vocab]
        assert ra == rb and len(ra) > 1
        # rows loaded per round; the first round differs after the first request, because the
        # staged path also loads a set after a request's last round (never drafted from)
        ga = [ev.vocab.rows_gathered for ev in a if ev.vocab]
        gb = [ev.vocab.rows_gathered for ev in b if ev.vocab]
        assert ga[1:] == gb[1:]
        if prompt is prompts[0]:
            assert ga[0] == gb[0] > 0  # the first request starts from an empty head in both


def test_full_head_never_overlaps(target) -> None:
    assert not ActiveVocab(None, target.lm_head.weight, overlap=True).overlap

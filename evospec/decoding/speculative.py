"""The speculative round loop: draft a tree, verify it in one target forward, accept, compact.

Owns: one request's rounds. Per round: the drafter commits the pairs verified last round and
builds an EAGLE-2 tree (``tree.py``); the target runs every tree node in one forward under
the tree mask; acceptance (``verify.py``) picks the accepted path and the bonus token; the
target cache keeps only the root and the accepted path (``KVCache.compact``); the drafter
rewinds its tree slots. Yields one :class:`StepEvent` per round (the prefill's first token
is its own event; the drafter catches up on the prompt before it, the draft's prefill). Host
synchronisation happens only at the accept boundary.

With context lookup on (``TreeConfig.lookup``), a round whose context repeats an earlier
n-gram verifies that n-gram's continuation instead of a drafted tree (``lookup.py``); with the
n-gram table on (``TreeConfig.table_lookup``), a round where the context finds nothing verifies
the table's guesses (``ngram_table.py``). Under a JSON grammar (``TreeConfig.jump_forward``), a
round where the grammar forces text verifies that text before either (``json_guess.py``).

Two optional observers ride along: ``vocab`` (the active vocabulary, which owns the
drafter's head function) and ``adapt`` (the online adapter: it sees the committed pairs at
the round start, where it may also publish new draft weights, and the verified path at the
round end). Neither can change the output: the target verifies every token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from evospec.adapt.online import OnlineAdapter
from evospec.decoding.budget import Budget, cache_for, check_reuse, plan_budget
from evospec.decoding.drafter import Drafter
from evospec.decoding.events import StepEvent
from evospec.decoding.json_guess import JsonGuess
from evospec.decoding.logprobs import for_tokens
from evospec.decoding.lookup import LookupDraft
from evospec.decoding.ngram_table import NgramTable
from evospec.decoding.node_logits import NodeLogits
from evospec.decoding.penalties import Generated
from evospec.decoding.prefix import PrefixCache
from evospec.decoding.proposal import DraftSampler
from evospec.decoding.sampling import SamplingParams, pick_token
from evospec.decoding.tree import DraftTree, TreeConfig, build_tree, chain_tree
from evospec.decoding.verify import accept
from evospec.models.kv_cache import KVCache
from evospec.models.step import MAX_CHAIN
from evospec.models.transformer import Transformer
from evospec.vocab.active import ActiveVocab


@torch.inference_mode()
def generate_speculative(
    target: Transformer,
    drafter: Drafter | None,
    prompt: Sequence[int],
    params: SamplingParams,
    tree_cfg: TreeConfig,
    *,
    eos_ids: Sequence[int] = (),
    cache: KVCache | None = None,
    vocab: ActiveVocab | None = None,
    adapt: OnlineAdapter | None = None,
    prefetch: float | None = None,
    budget: Budget | None = None,
    draft_layers: tuple[int, ...] = (),
    ngrams: NgramTable | None = None,
    prefix_cache: PrefixCache | None = None,
    reuse: int = 0,
) -> Iterator[StepEvent]:
    """Rounds of one request. ``vocab`` (if given) must own the drafter's head function: it
    loads each round's active ids at the round's first draft LM-head call and observes each
    verified round. ``prefetch``: None projects every tree node onto the vocabulary in the
    verify forward; a threshold projects rows on demand (``node_logits.py``). ``budget``: planned
    by the caller (``budget.plan_budget`` with the tree's slack), else here. ``draft_layers``:
    the target layers whose outputs, concatenated, are the draft's features (EAGLE-3); empty:
    the target's final features (EAGLE-2). ``ngrams``: the model's n-gram table, read where
    ``tree_cfg.table_lookup`` is on.

    With ``tree_cfg.lookup`` a round whose context's last n-gram occurred before verifies the
    tokens that followed it (``lookup.py``) instead of drafting: the drafter's catch-up waits
    for the next drafted round, which commits every pair verified since, and the adapter
    learns from drafted rounds only. ``drafter`` None (the ``ngram`` method): the other rounds
    verify the root alone, a plain decode step. A round where the context finds nothing may
    verify the n-gram table's guesses instead (``tree_cfg.table_lookup``), the same way.

    ``prefix_cache`` (the decoder's ``PrefixCache``): keeps the target's features at every committed
    slot, so that a later prompt may reuse them; ``reuse``: the first slots of ``cache`` hold
    that many prompt tokens already, and ``prefix_cache`` their features (the prefill runs on the
    rest; the drafter and ``vocab`` still see the whole prompt)."""
    budget = budget or plan_budget(target, len(prompt), params, eos_ids=eos_ids, slack=tree_cfg.max_nodes)
    check_reuse(cache, reuse, len(prompt))
    if reuse and drafter is not None and (prefix_cache is None or prefix_cache.features is None):
        raise ValueError("a drafted method reuses slots only with the features kept for them")
    cache = cache_for(target, cache, budget.slots, keep=reuse)
    if drafter is not None:
        drafter.start(prompt, budget.slots + tree_cfg.draft_slots)
    rule = budget.rule
    device = target.device
    gen = params.make_generator(device)

    t0 = time.perf_counter()
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    positions = torch.arange(reuse, len(prompt), device=device)
    out = target(ids[:, reuse:], positions, cache, logits="last", aux_layers=draft_layers)
    generated = params.penalties.start(prompt)  # what penalties count
    root = pick_token(out.logits[0, -1], params, gen, generated)
    if generated is not None:
        generated.add([root])
    features, hidden = _draft_features(out, draft_layers), out.hidden[0]  # [P - reuse, D'], [P - reuse, D]
    if drafter is not None and prefix_cache is not None:
        prefix_cache.write(reuse, features, hidden if draft_layers else None)
        features = prefix_cache.features[: len(prompt)]  # [P, D']: the reused slots' too
        hidden = prefix_cache.final_features(len(prompt))  # [P, D]
    new, reason = rule.clip([root], 0)
    produced = len(new)
    # pairs the drafter has yet to commit (ngram: no drafter, nothing to keep)
    pending = _Pending(features, [*prompt[1:], root]) if drafter else None
    if pending is not None and adapt is None and reason is None:  # the draft's prefill
        drafter.catch_up(*pending.take())  # (an adapting draft commits it at its first round, recorded)
    yield StepEvent(
        tokens=new,
        verify_s=time.perf_counter() - t0,
        finish_reason=reason,
        prefill=True,
        cached_tokens=reuse,
        logprobs=for_tokens(params.logprobs, out.logits[0, -1:], new),
    )
    if reason is not None:
        return
    lookup = LookupDraft(tree_cfg, ngrams)
    lookup = lookup if lookup.active else None
    if lookup is not None:
        lookup.reset([*prompt, root])
    jump = _jump_forward(tree_cfg, generated, root)
    if vocab is not None:
        vocab.start(ids[0], hidden)
    if adapt is not None:
        adapt.start()

    while True:
        t0 = time.perf_counter()
        prefix = cache.length
        guess = jump.propose() if jump is not None else []
        if not guess and lookup is not None:
            guess = lookup.propose()
        looked_up = bool(guess) or drafter is None
        if looked_up:
            tree = chain_tree(root, guess, prefix, device)
        else:
            sampler = _sampler(tree_cfg, params, gen)
            tree = _draft_tree(drafter, root, pending.take(), prefix, tree_cfg, vocab, adapt, sampler)
        t1 = time.perf_counter()
        vout, rows, path, bonus = _verify(target, tree, cache, params, gen, prefetch, draft_layers, generated)
        lazy = isinstance(rows, NodeLogits)
        t2 = time.perf_counter()
        accepted = tree.tokens[1 : path.numel()].tolist() if tree.chain else tree.tokens[path[1:]].tolist()
        new, reason = rule.clip([*accepted, bonus], produced)
        produced += len(new)
        stats, path_logits = None, None
        if (vocab is not None and vocab.observes) or adapt is not None or params.logprobs is not None:
            path_logits = rows.stack(path.tolist()) if lazy else rows[path]  # [a + 1, V]
        if vocab is not None:
            stats = vocab.end_round(tree.tokens, path, [*accepted, bonus], path_logits, vout.hidden[0])
        if adapt is not None and not looked_up:
            verified = torch.tensor([*accepted, bonus], dtype=torch.long, device=device)  # [a + 1]
            mask = vocab.mask if vocab is not None else None
            adapt.end_round(tree.parents, path, verified, path_logits, mask)
        feats = None
        if pending is not None:  # [a + 1, D']: a chain's path is its first rows (a view, no gather)
            feats = _draft_features(vout, draft_layers)
            feats = feats[: path.numel()] if tree.chain else feats[path]
        if feats is not None and prefix_cache is not None:  # before the event: a last round's slots count too
            prefix_cache.write(prefix, feats, vout.hidden[0][path] if draft_layers else None)
        yield StepEvent(
            tokens=new,
            accepted=len(accepted),
            bonus=bonus,
            tree_size=tree.size - 1,
            draft_s=t1 - t0,
            verify_s=t2 - t1,
            finish_reason=reason,
            round_s=time.perf_counter() - t0,
            vocab=stats,
            looked_up=looked_up,
            logprobs=for_tokens(params.logprobs, path_logits, new) if path_logits is not None else None,
        )
        if reason is not None:
            return
        if generated is not None:
            generated.add(new)
        if pending is not None:
            pending.add(feats, [*accepted, bonus])
        if lookup is not None:
            lookup.extend([*accepted, bonus])
        if jump is not None:
            jump.extend(new)
        root = bonus


def _verify(target, tree: DraftTree, cache: KVCache, params, gen, prefetch, draft_layers, generated=None):
    """One target forward over the tree, acceptance (``generated``: the ids penalties count,
    the root included), and the cache keeping the accepted path: (forward output, rows -- [N, V]
    logits or lazily projected ``NodeLogits`` --, path [a + 1] incl. the root, bonus token)."""
    prefix = cache.length
    lazy = prefetch is not None and not recorded_verify(target, tree, draft_layers)
    vout = target(
        tree.tokens[None],
        tree.positions,
        cache,
        # a chain's mask is the causal one (None): the root alone is a plain decode step, and
        # the target then plans a chain's rows from its positions without reading a mask
        tree_mask=None if tree.chain or tree.size == 1 else tree.mask,
        logits="none" if lazy else ("last" if tree.size == 1 else "all"),
        aux_layers=draft_layers,
        tree_rows=tree.bits,
    )
    rows = NodeLogits(tree, vout.hidden[0], target.project_logits, prefetch) if lazy else vout.logits[0]
    path, bonus = accept(tree, rows, params, gen, generated)
    if tree.chain:  # the accepted nodes already sit right behind the prefix
        cache.trim(prefix + path.numel())
    else:
        cache.compact(prefix + path, prefix)
    return vout, rows, path, bonus


def _draft_tree(
    drafter: Drafter,
    root: int,
    pairs: tuple[torch.Tensor, torch.Tensor],  # the pairs verified since the last commit
    prefix: int,
    tree_cfg: TreeConfig,
    vocab: ActiveVocab | None,
    adapt: OnlineAdapter | None,
    sampler: DraftSampler | None = None,
) -> DraftTree:
    """A drafted round's tree: commit the pending pairs, then expand from the root (a sampled
    chain: ``sampler`` draws every token, the root's first child included)."""
    if vocab is not None:
        vocab.begin_round()
    features, tokens = pairs
    if adapt is not None:
        adapt.begin_round(features, tokens)
    root_logp, root_ids = drafter.commit(features, tokens, tree_cfg.top_k, choose=sampler)
    tree = build_tree(drafter, root, root_logp, root_ids, prefix, tree_cfg, sampler)
    drafter.rewind()
    return tree


def _jump_forward(tree_cfg: TreeConfig, generated: Generated | None, root: int) -> JsonGuess | None:
    """The request's jump-forward guesses where its output is held to a JSON grammar (and
    ``tree_cfg.jump_forward`` is on), following the output from its first token ``root``."""
    if not tree_cfg.jump_forward or generated is None or generated.grammar is None:
        return None
    jump = JsonGuess(generated.grammar, tree_cfg.jump_forward)
    jump.extend([root])
    return jump


def _sampler(tree_cfg: TreeConfig, params: SamplingParams, gen: torch.Generator) -> DraftSampler | None:
    """A round's draws where its chain is sampled (``tree.sample_drafts``, a sampled request, a
    chain); None: the draft proposes its most likely tokens."""
    if params.greedy or tree_cfg.top_k != 1 or not tree_cfg.sample_drafts:
        return None
    return DraftSampler(params, gen)


class _Pending:
    """Verified (feature, next token) pairs the drafter has not committed yet: one round's,
    or several after lookup rounds (they are committed together)."""

    def __init__(self, features: torch.Tensor, tokens: list[int]) -> None:
        self.features = [features]  # pieces of [m_i, D']
        self.tokens = list(tokens)  # [sum m_i]
        self._none = features.new_empty(0, features.shape[-1])  # [0, D']: take() with nothing pending

    def add(self, features: torch.Tensor, tokens: list[int]) -> None:
        self.features.append(features)
        self.tokens += tokens

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All pending pairs ([m, D'] features, [m] tokens; m may be 0), and none left."""
        if len(self.features) == 1:
            feats = self.features[0]
        else:
            feats = torch.cat(self.features) if self.features else self._none
        toks = torch.tensor(self.tokens, dtype=torch.long, device=feats.device)
        self.features, self.tokens = [], []
        return feats, toks


def recorded_verify(target: Transformer, tree: DraftTree, draft_layers: tuple[int, ...] = ()) -> bool:
    """True when the target verifies ``tree`` through a recorded graph (``models/step.py``: a
    chain, or any tree where the graph takes trees): project every row in that graph. The LM
    head reads its weights once for all rows -- SmolLM2 int4 here: 0.76 ms for 3 rows, 0.59 ms
    for one -- and lazy verification projected 1.15 rows per round of a 2-token chain, each on
    its own."""
    graph = target.step_graph
    if graph is None or graph.failed:
        return False
    if not tree.chain and graph.takes_tree(tree.size, draft_layers):
        return True
    # a chain: one node per depth
    return tree.size <= MAX_CHAIN and (tree.chain or int(tree.depths[-1]) == tree.size - 1)


def _draft_features(out, draft_layers: tuple[int, ...]) -> torch.Tensor:
    """What the drafter reads of a target forward: [n, D] final features, or the outputs of
    ``draft_layers`` concatenated, [n, 3 D] (EAGLE-3)."""
    if not draft_layers:
        return out.hidden[0]
    return torch.cat(out.aux_hidden, dim=-1)[0]

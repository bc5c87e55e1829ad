"""Acceptance of a verified draft tree: greedy and lossless tree rejection sampling.

Owns: turning the target's logits at tree nodes into (accepted path, bonus token). The rows
come either all at once ([N, V] from the verify forward) or on demand
(``node_logits.NodeLogits``: only the nodes the walk visits, plus what it prefetches).
Glossary: *accepted tokens* are draft nodes the target agreed with; the *bonus token* is the
target's own next token after the last accepted node. Tokens per round = accepted + 1.

Greedy: the accepted path is the longest root-to-node path whose every token equals the
target's argmax at its parent; the bonus is the argmax at the path's end. Each such token is
exactly what plain greedy decoding would emit, so the output is identical. Children of one
node are distinct tokens, so the path is unique.

Sampling (tree rejection sampling with deterministic drafts, as in SpecInfer's multi-step
speculative sampling (Miao et al., ASPLOS 2024) specialised to a point-mass proposal, and as
implemented for EAGLE's top-k trees): at the current node u let p = the target distribution
after temperature / top-k / top-p (``sampling.target_probs``, the same transform plain
decoding uses). Visit u's children c_1, c_2, ... in draft-score order; accept c_i with
probability p(c_i) / sum(p) over the tokens not yet rejected at u, otherwise set p(c_i) = 0
and go on. If some child is accepted, move to it and repeat; if none is (or u is a leaf),
the bonus token is drawn from the remaining p, renormalised.

Why it is lossless: at a node this is sequential sampling without replacement. The chance of
emitting c_1 is p(c_1); of c_2, (1 - p(c_1)) * p(c_2) / (1 - p(c_1)) = p(c_2); and of any
other token z, prod_i(1 - p(c_i)/m_i) * p(z)/m_end = p(z) because the remaining masses m
telescope. So every emitted token is distributed exactly as p given the prefix, which by
induction over positions gives the target's joint distribution. (Draft probabilities do not
appear: the proposal is a point mass on each child, so its ratio p/q is p.)

Penalties (``penalties.py``: presence, frequency, repetition penalties, ``logit_bias``): p and the argmax
are taken from each visited node's row adjusted for the node's own history -- the request's
output so far plus the drafted tokens on the node's path -- the row plain decoding would pick
from at that position had it produced that path; greedy acceptance then walks the tree.

Sampled chains (``DraftTree.proposals``, ``proposal.py``): node i + 1's token x was drawn from
the draft's distribution q at node i. It is accepted with probability min(1, p(x) / q(x)); at
the first rejection the bonus is drawn from max(p - q, 0) renormalised, after the last node
from p (speculative sampling, Leviathan et al. 2023). Lossless: the chance of emitting z at the
node is q(z) min(1, p(z)/q(z)) + (1 - sum_y min(p(y), q(y))) (p(z) - q(z))^+ / sum_y (p(y) - q(y))^+
= min(p(z), q(z)) + (p(z) - q(z))^+ = p(z), since sum_y (p - q)^+ = 1 - sum_y min(p, q). A chain
is accepted by this rule with probability 1 - TV(p, q) a node, against p(x) for a point mass.
"""

from __future__ import annotations

import torch

from evospec.decoding.node_logits import NodeLogits
from evospec.decoding.penalties import Generated, Penalties, adjusted
from evospec.decoding.sampling import SamplingParams, draw, greedy_ids, target_probs
from evospec.decoding.tree import DraftTree

Rows = torch.Tensor | NodeLogits  # [N, V] logits of every node, or rows projected on demand


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """logits [N, V] -> (path [a + 1] node indices incl. the root, bonus token).

    One host synchronisation: reading the chosen path's end (a chain: reading its N argmaxes,
    which decide it on the host).
    """
    if tree.chain:
        return _greedy_chain(tree, logits)
    if logits.device.type == "cpu":
        return _greedy_host(tree, logits)
    return _greedy_tensors(tree, logits)


def _greedy_tensors(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`greedy_accept` for a branching tree in tensor ops (an accelerator's logits)."""
    pred = greedy_ids(logits)  # [N]
    parent = tree.parents.clamp(min=0)
    correct = tree.tokens == pred[parent]
    correct[0] = True
    ok = correct
    for _ in range(tree.max_depth):
        ok = correct & ok[parent]
    reach = torch.where(ok, tree.depths, torch.full_like(tree.depths, -1))
    best = int(torch.argmax(reach))  # host sync (the accept boundary)
    return tree.path_to(best), int(pred[best])


def _greedy_chain(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`greedy_accept` for a chain: node i is accepted while each token so far equals
    the argmax of the row before it."""
    pred = greedy_ids(logits).tolist()  # [N]
    drafted = tree.tokens.tolist()
    a = 0
    while a + 1 < len(drafted) and drafted[a + 1] == pred[a]:
        a += 1
    return tree.depths[: a + 1], pred[a]  # a chain's depths are its node indices


def _greedy_host(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """:func:`greedy_accept` for a branching tree whose logits sit on the host: the N argmaxes
    read once, the path walked over the tree's lists (the vectorised pass is ~10 small tensor
    ops, each slow right after a forward)."""
    pred = greedy_ids(logits).tolist()  # [N]
    children: dict[tuple[int, int], int] = {}
    for node, (par, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if par >= 0:
            children.setdefault((par, tok), node)  # siblings are distinct tokens
    path = [0]
    while (child := children.get((path[-1], pred[path[-1]]))) is not None:
        path.append(child)
    return torch.tensor(path, device=tree.tokens.device), pred[path[-1]]


def greedy_walk(tree: DraftTree, rows: Rows) -> tuple[torch.Tensor, int]:
    """:func:`greedy_accept` reading rows only along the way (root, then each accepted
    node): the same path and bonus, with one host synchronisation per visited node."""
    children: dict[int, dict[int, int]] = {}
    for node, (par, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if par >= 0:
            children.setdefault(par, {})[tok] = node  # siblings are distinct tokens
    path = [0]
    while True:
        best = int(greedy_ids(rows[path[-1]]))
        child = children.get(path[-1], {}).get(best)
        if child is None:
            return torch.tensor(path, device=tree.tokens.device), best
        path.append(child)


def sample_accept(
    tree: DraftTree, logits: Rows, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Tree rejection sampling, or the ratio test along a sampled chain (see module docstring);
    reads ``logits[node]`` ([V]) only for the nodes it visits."""
    if tree.proposals is not None:
        return _sample_chain(tree, logits, params, gen)
    children: dict[int, list[int]] = {}
    for node, par in enumerate(tree.parents.tolist()):
        if par >= 0:
            children.setdefault(par, []).append(node)  # any fixed order is lossless
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        p = target_probs(logits[node], params)  # [V] a fresh tensor: edited below
        moved = False
        for child in children.get(node, ()):
            mass = p.sum()
            tok = tokens[child]
            u = torch.rand((), generator=gen, device=p.device)
            if mass > 0 and u * mass < p[tok]:
                path.append(child)
                node = child
                moved = True
                break
            p[tok] = 0.0
        if not moved:
            bonus = draw(p, gen)
            return torch.tensor(path, device=tree.tokens.device), bonus


def _sample_chain(
    tree: DraftTree, logits: Rows, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Speculative sampling along a chain whose node i + 1 was drawn from ``tree.proposals[i]``:
    accept it with probability min(1, p(x) / q(x)); at the first rejection the bonus is drawn
    from max(p - q, 0), after the last accepted node from p."""
    tokens = tree.tokens.tolist()
    node = 0
    while True:
        p = target_probs(logits[node], params)  # [V]
        if node + 1 < tree.size:
            proposal, token = tree.proposals[node], tokens[node + 1]
            u = float(torch.rand((), generator=gen, device=p.device))
            if u * proposal.token_prob < float(p[token]):
                node += 1
                continue
            residual = (p - proposal.dense(p)).clamp_(min=0.0)
            # mass is left wherever the draw was rejected (p(x) < q(x)); rounding aside
            p = residual if float(residual.sum()) > 0 else p
        return torch.arange(node + 1, device=tree.tokens.device), draw(p, gen)


def accept(
    tree: DraftTree,
    rows: Rows,
    params: SamplingParams,
    gen: torch.Generator,
    generated: Generated | None = None,
) -> tuple[torch.Tensor, int]:
    """(path [a + 1] node indices incl. the root, bonus token) from every node's logits
    ([N, V]: one vectorised greedy pass) or from :class:`NodeLogits` (a walk). With
    ``params.penalties`` the walk reads each visited node's row adjusted for its own history:
    ``generated`` (the request's output so far, the root included) and the drafted tokens on
    the node's path."""
    if params.penalties.active:
        rows = _Adjusted(tree, rows, params.penalties, generated or Generated())
    if not params.greedy:
        return sample_accept(tree, rows, params, gen)
    if isinstance(rows, NodeLogits | _Adjusted):
        return greedy_walk(tree, rows)
    return greedy_accept(tree, rows)


class _Adjusted:
    """Rows as a penalised request picks from them: ``self[node]`` is the node's row adjusted
    (``penalties.adjusted``) for ``generated`` plus the tokens on its path below the root."""

    def __init__(self, tree: DraftTree, rows: Rows, penalties: Penalties, generated: Generated) -> None:
        self.rows, self.penalties, self.generated = rows, penalties, generated
        self.parents, self.tokens = tree.parents.tolist(), tree.tokens.tolist()

    def __getitem__(self, node: int) -> torch.Tensor:
        path, up = [], node
        while up > 0:  # the root's token is already in ``generated``
            path.append(self.tokens[up])
            up = self.parents[up]
        path.reverse()  # root first: the JSON grammar reads the tokens in order
        history = self.generated.plus(path) if path and self.penalties.history else self.generated
        return adjusted(self.rows[node], self.penalties, history)

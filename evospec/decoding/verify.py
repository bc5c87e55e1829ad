"""Acceptance of a verified draft tree: greedy and lossless tree rejection sampling.

Owns: turning the target's logits over every tree node into (accepted path, bonus token).
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
"""

from __future__ import annotations

import torch

from evospec.decoding.sampling import SamplingParams, target_probs
from evospec.decoding.tree import DraftTree


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """logits [N, V] -> (path [a + 1] node indices incl. the root, bonus token).

    One host synchronisation: reading the chosen path's end.
    """
    pred = torch.argmax(logits, dim=-1)  # [N]
    parent = tree.parents.clamp(min=0)
    correct = tree.tokens == pred[parent]
    correct[0] = True
    ok = correct
    for _ in range(tree.max_depth):
        ok = correct & ok[parent]
    reach = torch.where(ok, tree.depths, torch.full_like(tree.depths, -1))
    best = int(torch.argmax(reach))  # host sync (the accept boundary)
    return tree.path_to(best), int(pred[best])


def sample_accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Tree rejection sampling (see module docstring). logits [N, V]."""
    probs = target_probs(logits, params)  # [N, V]
    children: dict[int, list[int]] = {}
    for node, par in enumerate(tree.parents.tolist()):
        if par >= 0:
            children.setdefault(par, []).append(node)  # any fixed order is lossless
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        p = probs[node].clone()
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
            bonus = int(torch.multinomial(p / p.sum(), 1, generator=gen))
            return torch.tensor(path, device=tree.tokens.device), bonus


def accept(
    tree: DraftTree, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    if params.greedy:
        return greedy_accept(tree, logits)
    return sample_accept(tree, logits, params, gen)

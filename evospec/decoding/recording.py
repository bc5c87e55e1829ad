"""Recording every graph a set of decoders will run, before any of them is timed or serves.

Owns: :func:`record_steps`. A traced graph is recorded on first use and then needs a few
warm calls (``models/step.py``, ``WARM_CALLS``); a round that met a shape first paid ~0.2 s
for a SmolLM2 verify or ~50 ms for a draft step. Drafter catch-ups commit any of 1..MAX_CHAIN
pairs, depending on how the rounds before fell, so a short benchmark or the first requests
of a server met new sizes for a long while (here 16 draft sizes in ~100 drafted rounds put
~4 ms on each). Calling this once after building the decoders moves all of it to start-up.
"""

from __future__ import annotations

from collections.abc import Iterable

from evospec.models.step import MAX_CHAIN


def record_steps(model, decoders: Iterable) -> None:
    """Record and warm the graphs ``decoders`` will run on ``model`` (~1 s per verify shape for
    SmolLM2 here, ~50 ms per draft size): the one-token step, each chain tree's verification
    (and each branching tree size's, where the target's graphs take trees), each model-free
    round's, and every drafter catch-up size."""
    decoders = list(decoders)
    for dec in decoders:
        draft_graph = getattr(getattr(dec, "drafter", None), "graph", None)
        for n in range(1, MAX_CHAIN + 1) if draft_graph is not None else ():
            draft_graph.record(n)  # shared per head: recorded once for every decoder using it
    graph = getattr(model, "step_graph", None)
    if graph is None:
        return
    graph.record(1, "last")
    for dec in decoders:
        tree = getattr(dec, "tree", None)
        if tree is None:
            continue
        aux = getattr(dec, "draft_layers", ())  # EAGLE-3 drafts read three target layers
        if tree.top_k == 1:  # a chain: the root and its drafted tokens (a stopping chain: any count)
            longest = min(tree.depth, tree.total_tokens)
            for n in range(2 if tree.min_prob else longest + 1, longest + 2):
                graph.record(n, "all", aux)
        elif graph.trees and not aux:  # a branching tree: the root and its nodes (a fan: top_k of them)
            nodes = min(tree.top_k, tree.total_tokens) if tree.depth == 1 else tree.total_tokens
            graph.record(nodes + 1, "all", tree=True)
        for n in range(1, tree.lookup_rows + 1):  # a model-free round: the root and 1..lookup tokens
            graph.record(n + 1, "all", aux)

"""Context lookup: draft tokens by finding the context's last n-gram earlier in the context.

Owns: :class:`ContextLookup`, an index of one request's tokens (prompt, then every verified
token) by the n-grams that end before each position, and :meth:`ContextLookup.propose`, which
finds the most recent earlier occurrence of the context's last n tokens (longest n first,
down to ``min_n``) and returns the tokens that followed it; :class:`LookupDraft`, a round's
model-free proposal: the context's, else the model's n-gram table's (``ngram_table.py``).

Context lookup is the "prompt lookup" / n-gram drafting of vLLM's ``ngram`` method and
llama.cpp's lookup decoding: it costs no model call, and where answers copy from their
context (summaries, extraction, RAG, code edits, translations that keep names) it is right
more often than a small draft head.

Measured on the default model (SmolLM2-135M, the AR answers to 39 Spec-Bench prompts, 96
tokens; ``scripts/lookup_study.py``): at 19% of positions the last 5 tokens had occurred
before, and the token after that occurrence was the target's next token 85% of the time
(longest match 3: 67%, 2: 41%, 1: 22%), against ~32% for the shipped EAGLE head's first draft
token (``docs/benchmarks.md``, wave 7). Knows token ids only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from evospec.decoding.ngram_table import MAX_ORDER, NgramTable
from evospec.decoding.tree_config import LOOKUP_MAX_N, TreeConfig


class ContextLookup:
    """n-gram index of one request's context; ``extend`` it with each verified token."""

    def __init__(self, min_n: int = 3, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"lookup n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # by n: n-gram -> the index of the token that followed its latest occurrence
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}

    def reset(self, tokens: Iterable[int] = ()) -> None:
        """Start a new context (a request's prompt)."""
        self.tokens = []
        for table in self._next.values():
            table.clear()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append verified tokens; each makes the n-grams ending just before it findable."""
        ctx = self.tokens
        for tok in tokens:
            i = len(ctx)  # the new token's index: it follows the n-grams ending at i - 1
            for n, table in self._next.items():
                if i >= n:
                    table[tuple(ctx[i - n : i])] = i
            ctx.append(int(tok))

    def find(self) -> tuple[int, int] | None:
        """(n, index of the token that followed) for the latest earlier occurrence of the
        context's last n tokens, the longest n in [min_n, max_n] that occurred; None if none."""
        ctx = self.tokens
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            start = self._next[n].get(tuple(ctx[-n:]))
            if start is not None:
                return n, start
        return None

    def propose(self, k: int) -> list[int]:
        """Up to ``min(k, n)`` of the tokens after :meth:`find`'s match (a longer match is
        trusted for longer); [] if there is none."""
        match = self.find()
        if match is None:
            return []
        n, start = match
        return self.tokens[start : start + min(k, n)]


class LookupDraft:
    """One request's model-free proposals: context lookup first (up to ``tree.lookup`` tokens),
    else the model's n-gram table (up to ``tree.table_lookup``); [] where neither has a guess."""

    def __init__(self, tree: TreeConfig, table: NgramTable | None) -> None:
        check_table(tree, table)
        self.tree = tree
        self.context = ContextLookup(tree.lookup_ngram, LOOKUP_MAX_N) if tree.lookup else None
        self.table = table if tree.table_lookup else None
        self._keep = table.info.max_order if table is not None else MAX_ORDER  # the table's longest context
        self._tail: list[int] = []  # the last tokens, kept only when no context index holds them all

    @property
    def active(self) -> bool:
        return self.context is not None or self.table is not None

    def reset(self, tokens: Sequence[int]) -> None:
        if self.context is not None:
            self.context.reset(tokens)
        else:
            self._tail = list(tokens[-self._keep :])

    def extend(self, tokens: Sequence[int]) -> None:
        if self.context is not None:
            self.context.extend(tokens)
        else:
            self._tail = [*self._tail, *tokens][-self._keep :]

    def propose(self) -> list[int]:
        if self.context is not None:
            guess = self.context.propose(self.tree.lookup)
            if guess:
                return guess
        if self.table is not None:
            tail = self.context.tokens if self.context is not None else self._tail  # propose() slices it
            return self.table.propose(tail, self.tree.table_lookup, self.tree.table_min_share)
        return []


def check_table(tree: TreeConfig, table: NgramTable | None) -> None:
    """ValueError where ``tree`` reads the n-gram table and there is none."""
    if tree.table_lookup and table is None:
        raise ValueError(
            f"tree.table_lookup {tree.table_lookup} needs the model's n-gram table (--ngrams PATH)"
        )

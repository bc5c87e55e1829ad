"""The draft tree's shape: one typed record, read by the tree builder, the decoders, the tuner,
the serve config's ``tree:`` section and the tree flags (see ``evospec/settings.py``). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from evospec.settings import setting

LOOKUP_MAX_N = 5  # the longest n-gram context lookup tries first
# fields that are no part of the shape ``--tree auto`` measures: a JSON request's forced text
NOT_TUNED = frozenset({"jump_forward"})


def names_a_shape(keys) -> bool:
    """Whether settings giving these :class:`TreeConfig` keys choose a shape (what ``--tree
    auto`` would measure): then that shape is served as given, unless tuning is asked for too."""
    return bool(set(keys) - NOT_TUNED)


@dataclass(frozen=True)
class TreeConfig:
    """The draft tree's shape (the ``tree:`` section of a serve config; the tree flags)."""

    top_k: int = setting(10, "tree: children per expanded node and frontier width", flag="--top-k-tree")
    depth: int = setting(5, "tree: draft levels per round (most accepted tokens)")
    total_tokens: int = setting(60, "tree: draft tokens verified per round")
    lookup: int = setting(
        0,
        "context lookup: in rounds where the context's last n-gram occurred before, verify up to this "
        "many of the tokens that followed it instead of drafting; 0: off (the ngram method: 3)",
    )
    lookup_ngram: int = setting(
        2,
        "context lookup: the shortest n-gram that counts as a match (longest: 5); n matched tokens "
        "propose at most n",
    )
    table_lookup: int = setting(
        0,
        "n-gram table: in rounds where context lookup finds nothing, verify up to this many tokens "
        "the model's n-gram table (built from its own answers; --ngrams) predicts instead of drafting; "
        "0: off",
    )
    table_min_share: float = setting(
        0.3,
        "n-gram table: guess a token only where it followed the context in at least this share of the "
        "model's answers (the table keeps every context's most frequent next token and its share); "
        "--tree auto also measures 0.12. On Spec-Bench guesses with shares from 0.12 to 0.3 were right "
        "about 1 time in 7, those below 0.12 about 1 in 30",
    )
    jump_forward: int = setting(
        4,
        "JSON mode / schemas: in rounds where the grammar leaves no choice (a property's name, its "
        "quotes and colon, a closing bracket), verify up to this many tokens of that text, spaced as "
        "the answer spaces it, before context lookup; 0: off",
    )
    min_prob: float = setting(
        0.0,
        "chain (top-k-tree 1): draft the next token only while the draft's probability of the whole "
        "chain so far stays at or above this, so confident rounds verify up to depth tokens and "
        "doubtful ones none (a plain step); 0: always depth tokens",
    )
    sample_drafts: bool = setting(
        True,
        "chain (top-k-tree 1) under sampling: draw each drafted token from the draft's own "
        "distribution (at the request's temperature) and accept it with probability min(1, p/q), "
        "speculative sampling; no: propose the draft's most likely token (accepted with the "
        "target's probability of it). Lossless either way",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.sample_drafts, bool):
            raise ValueError(f"tree.sample_drafts must be true or false, got {self.sample_drafts!r}")
        for name in (
            "top_k",
            "depth",
            "total_tokens",
            "lookup",
            "lookup_ngram",
            "table_lookup",
            "jump_forward",
        ):
            v = getattr(self, name)
            least = 0 if name in ("lookup", "table_lookup", "jump_forward") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"tree.{name} must be an integer >= {least}, got {v!r}")
        p = self.min_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise ValueError(f"tree.min_prob must be a number in [0, 1), got {self.min_prob!r}")
        s = self.table_min_share
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s <= 1:
            raise ValueError(f"tree.table_min_share must be a number in [0, 1], got {s!r}")
        if self.min_prob and self.top_k != 1:
            raise ValueError("tree.min_prob stops chains: it needs tree.top_k 1")
        if self.lookup_ngram > LOOKUP_MAX_N:
            raise ValueError(f"tree.lookup_ngram must be <= {LOOKUP_MAX_N}, got {self.lookup_ngram}")

    @property
    def max_nodes(self) -> int:
        """Upper bound on nodes incl. the root (for preallocating caches)."""
        pool = self.top_k + (self.depth - 1) * self.top_k * self.top_k
        return 1 + max(min(self.total_tokens, pool), self.lookup_rows)

    @property
    def lookup_rows(self) -> int:
        """The most tokens a model-free round verifies after its root."""
        return max(self.lookup, self.table_lookup, self.jump_forward)

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots the frontier expansions write in one round."""
        return self.depth * self.top_k

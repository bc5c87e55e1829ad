"""The draft tree's shape: one typed record, read by the tree builder, the decoders, the tuner,
the serve config's ``tree:`` section and the tree flags (see ``evospec/settings.py``). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from evospec.settings import setting


@dataclass(frozen=True)
class TreeConfig:
    """The draft tree's shape (the ``tree:`` section of a serve config; the tree flags)."""

    top_k: int = setting(10, "tree: children per expanded node and frontier width", flag="--top-k-tree")
    depth: int = setting(5, "tree: draft levels per round (most accepted tokens)")
    total_tokens: int = setting(60, "tree: draft tokens verified per round")

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"tree.{name} must be an integer >= 1, got {v!r}")

    @property
    def max_nodes(self) -> int:
        """Upper bound on nodes incl. the root (for preallocating caches)."""
        pool = self.top_k + (self.depth - 1) * self.top_k * self.top_k
        return 1 + min(self.total_tokens, pool)

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots the frontier expansions write in one round."""
        return self.depth * self.top_k

"""The model's n-gram table: next-token guesses from its own past answers, at no model cost.

Owns: :class:`NgramTable`, built from token sequences the target wrote (its greedy answers to
training-side prompts: ``evospec train-draft --generate-only`` makes them) by counting, for
every context of 1..``max_order`` tokens seen at least ``min_count`` times, its most frequent
next token and that token's share. :meth:`NgramTable.propose` chains guesses from the longest
context the table holds while each guess's share is at least ``min_share``. Saved as one
safetensors file (hashed contexts, next ids, shares) with the build record in its metadata;
:func:`load_ngram_table` checks it against the served model's vocabulary. Where a user's
table lives: :func:`user_table_path` (the package's own: ``models/registry.py:
default_ngrams``).

This is llama.cpp's static lookup cache: where context lookup (``lookup.py``) finds no earlier
occurrence, the phrasing the model keeps using ("Here is a", "step by step", list markup) is
often still predictable. Measured on the default model (the AR answers to 39 Spec-Bench
prompts, a table from its 517k-token answers to training prompts; ``docs/benchmarks.md``,
wave 8): at the positions where context lookup finds nothing, a guess with share >= 0.3 exists
at 65% and is right 39% of the time (45% where the share is >= 0.5), against ~32% for the
shipped EAGLE head's first token, which costs a draft forward. A wrong guess costs one extra
verified row; the output never depends on the table. Knows token ids only.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

MAX_ORDER = 4  # the longest context the table keys
_MOD = (1 << 61) - 1  # contexts are hashed into [0, 2^61): a collision costs a wrong guess, never output
_MUL = 1_000_003
FORMAT = "evospec-ngram-table-v1"


@dataclass(frozen=True)
class TableInfo:
    """How a table was built (its file's metadata)."""

    model: str  # the target whose answers were counted
    vocab_size: int
    tokens: int  # tokens counted: the answers and the few prompt tokens before each
    sequences: int
    max_order: int = MAX_ORDER
    min_count: int = 2  # contexts seen fewer times are left out
    min_share: float = 0.3  # propose() guesses only where the next token had at least this share
    source: str = ""  # what was counted (a path, a description)


def user_table_path(model_name: str) -> Path:
    """Where ``evospec build-ngrams`` saves a model's table by default, and serving looks first."""
    from evospec.common import evospec_home

    return evospec_home() / "ngrams" / f"{model_name}.safetensors"


def context_keys(tail: Sequence[int], max_order: int) -> list[int]:
    """Hashes of the last 1, 2, ..., ``max_order`` tokens of ``tail`` (fewer if it is shorter)."""
    keys, h = [], 0
    for tok in reversed(tail[-max_order:]):
        h = (h * _MUL + int(tok) + 1) % _MOD
        keys.append(h)
    return keys


class NgramTable:
    """Hashed context -> (most frequent next token, its share); immutable once built."""

    def __init__(
        self, keys: torch.Tensor, next_ids: torch.Tensor, shares: torch.Tensor, info: TableInfo
    ) -> None:
        if not keys.numel() == next_ids.numel() == shares.numel():
            raise ValueError("n-gram table: keys, next_ids and shares differ in length")
        self.info = info
        self.keys, self.next_ids, self.shares = keys, next_ids, shares  # [E] int64, int32, float16
        guesses = zip(next_ids.tolist(), shares.float().tolist(), strict=True)
        self._map = dict(zip(keys.tolist(), guesses, strict=True))

    def __len__(self) -> int:
        return len(self._map)

    def guess(self, tail: Sequence[int]) -> tuple[int, float] | None:
        """(next token, share) from the longest context of ``tail`` the table holds; None if none."""
        found = None
        for key in context_keys(tail, self.info.max_order):
            hit = self._map.get(key)
            if hit is None:
                break  # a longer context is only kept where its shorter one was seen as often
            found = hit
        return found

    def propose(self, tail: Sequence[int], k: int, min_share: float | None = None) -> list[int]:
        """Up to ``k`` chained guesses after ``tail``, each with share >= ``min_share`` (default:
        ``info.min_share``, the threshold the table was built with; serving passes
        ``TreeConfig.table_min_share``)."""
        least = self.info.min_share if min_share is None else min_share
        ctx = list(tail[-self.info.max_order :])
        out: list[int] = []
        while len(out) < k:
            hit = self.guess(ctx)
            if hit is None or hit[1] < least:
                break
            out.append(hit[0])
            ctx = [*ctx[1:], hit[0]] if len(ctx) == self.info.max_order else [*ctx, hit[0]]
        return out

    @classmethod
    def count(
        cls,
        sequences: Iterable[Sequence[int]],
        *,
        model: str,
        vocab_size: int,
        max_order: int = MAX_ORDER,
        min_count: int = 2,
        min_share: float = 0.3,
        source: str = "",
    ) -> NgramTable:
        """Count every context of 1..``max_order`` tokens in ``sequences`` (each one answer,
        optionally led by the prompt tokens that precede it)."""
        if not 1 <= max_order <= 8 or min_count < 1 or not 0.0 < min_share <= 1.0:
            raise ValueError(f"bad n-gram table settings: {max_order=}, {min_count=}, {min_share=}")
        counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        tokens = seqs = 0
        for seq in sequences:
            seqs += 1
            tokens += len(seq)
            for i in range(1, len(seq)):
                nxt = int(seq[i])
                if not 0 <= nxt < vocab_size:
                    raise ValueError(f"n-gram table: token id {nxt} is outside the vocabulary ({vocab_size})")
                for key in context_keys(seq[max(0, i - max_order) : i], max_order):
                    counts[key][nxt] += 1
        keys, ids, shares = [], [], []
        for key, c in counts.items():
            total = sum(c.values())
            if total >= min_count:
                tok, n = c.most_common(1)[0]
                keys.append(key)
                ids.append(tok)
                shares.append(n / total)
        info = TableInfo(model, vocab_size, tokens, seqs, max_order, min_count, min_share, source)
        return cls(
            torch.tensor(keys, dtype=torch.int64),
            torch.tensor(ids, dtype=torch.int32),
            torch.tensor(shares, dtype=torch.float16),
            info,
        )

    def save(self, path: str | Path) -> None:
        from evospec.common import save_tensors

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"keys": self.keys, "next_ids": self.next_ids, "shares": self.shares}
        save_tensors(tensors, str(path), metadata={"format": FORMAT, "info": json.dumps(asdict(self.info))})


def load_ngram_table(path: str | Path, vocab_size: int | None = None) -> NgramTable:
    """Read a saved table; ValueError naming what is wrong (not a table, another vocabulary)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"n-gram table {path} is a folder; name the table's .safetensors file in it")
    if not path.is_file():
        raise FileNotFoundError(f"n-gram table {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in ("keys", "next_ids", "shares")}
    except Exception as exc:  # a damaged file or a missing tensor: say which file
        raise ValueError(f"{path} is not an n-gram table: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not an n-gram table (format {meta.get('format')!r}, expected {FORMAT})")
    try:
        info = TableInfo(**json.loads(meta["info"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: the n-gram table's build record is unreadable: {exc}") from exc
    keys, next_ids, shares = tensors["keys"], tensors["next_ids"], tensors["shares"]
    if (keys.dtype, next_ids.dtype, shares.dtype) != (torch.int64, torch.int32, torch.float16) or not (
        keys.dim() == next_ids.dim() == shares.dim() == 1
    ):
        raise ValueError(f"{path}: keys, next_ids and shares must be 1-D int64, int32 and float16")
    if next_ids.numel() and not (int(next_ids.min()) >= 0 and int(next_ids.max()) < info.vocab_size):
        raise ValueError(f"{path}: next_ids outside the table's vocabulary ({info.vocab_size})")
    if vocab_size is not None and info.vocab_size != vocab_size:
        raise ValueError(
            f"n-gram table {path}: vocab_size {info.vocab_size} (built for {info.model}) does not match "
            f"the served model's {vocab_size}"
        )
    return NgramTable(keys, next_ids, shares, info)

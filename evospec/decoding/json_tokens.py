"""One model's tokens as bytes, for JSON grammars (``json_grammar.py``) and their guesses
(``json_guess.py``).

Owns: :class:`TokenTable` -- each token's bytes (None for a token that is never text), the
per-token facts a grammar's masks read at once (first two bytes, plain string bytes, code
points begun, every token's bytes padded into one tensor) and :meth:`TokenTable.encode`, text
back to the ids the model's tokenizer writes for it. Built once per model (~0.9 s for 49k
tokens: ``TokenTable.for_codec``); knows bytes and token ids only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class TokenTable:
    """One model's tokens as bytes. ``pieces[i]``: token i's bytes, None for a token that is
    never text (special / added tokens); ``eos_ids`` end the text once the value is closed;
    ``vocab_size``: the model's row length (>= len(pieces))."""

    def __init__(
        self,
        pieces: Sequence[bytes | None],
        eos_ids: Sequence[int],
        vocab_size: int,
        encode: Callable[[bytes], list[int]] | None = None,
    ) -> None:
        if vocab_size < len(pieces):
            raise ValueError(f"JSON grammar: {len(pieces)} token pieces for a {vocab_size}-token row")
        if not eos_ids:
            raise ValueError("JSON grammar: the model names no EOS token to end the value with")
        self.pieces = [p if p else None for p in pieces]
        self.eos_ids = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
        self.vocab_size = vocab_size
        first = torch.full((vocab_size,), 256, dtype=torch.long)  # 256: no byte (never text)
        second = torch.full((vocab_size,), 256, dtype=torch.long)  # 256: a one-byte token
        self.plain = torch.zeros(vocab_size, dtype=torch.bool)  # only bytes a string takes as they are
        self.texts = torch.zeros(vocab_size, dtype=torch.bool)
        self.chars = torch.zeros(vocab_size, dtype=torch.long)  # code points begun (UTF-8 lead bytes)
        for i, p in enumerate(self.pieces):
            if p is not None:
                first[i] = p[0]
                second[i] = p[1] if len(p) > 1 else 256
                self.plain[i] = all(c >= 0x20 and c not in b'"\\' for c in p)
                self.texts[i] = True
                self.chars[i] = sum(1 for c in p if c & 0xC0 != 0x80)
        self.pair = first * 257 + second  # [V]: index into a state's (first, second) byte table
        self._padded: torch.Tensor | None = None
        self._encode = encode
        self._ids: dict[bytes, int] | None = None  # piece -> id, for encode without a tokenizer

    def encode(self, data: bytes) -> list[int]:
        """Token ids for ``data`` as the model's tokenizer writes it (the codec's, where the table
        came from one); else the longest piece at each position (tables built in tests)."""
        if self._encode is not None:
            return self._encode(data)
        if self._ids is None:
            self._ids = {p: i for i, p in reversed(list(enumerate(self.pieces))) if p is not None}
        out, at, longest = [], 0, max(map(len, self._ids), default=1)
        while at < len(data):
            lengths = range(min(longest, len(data) - at), 0, -1)
            n = next((n for n in lengths if data[at : at + n] in self._ids), 0)
            if not n:
                break  # no piece spells this byte: the guess stops before it
            out.append(self._ids[data[at : at + n]])
            at += n
        return out

    @property
    def padded(self) -> torch.Tensor:
        """[V, L] every token's bytes, padded with 256 (no byte) to the longest (built once;
        int16: 8 MB for 49k tokens)."""
        if self._padded is None:
            longest = max((len(p) for p in self.pieces if p is not None), default=1)
            out = torch.full((self.vocab_size, longest), 256, dtype=torch.int16)
            for i, p in enumerate(self.pieces):
                if p is not None:
                    out[i, : len(p)] = torch.tensor(list(p))
            self._padded = out
        return self._padded

    @classmethod
    def for_codec(cls, codec, eos_ids: Sequence[int], vocab_size: int) -> TokenTable:
        """The table of ``codec``'s tokens (``TextCodec``; ~0.9 s for 49k tokens)."""
        added = set(codec.added_ids)
        pieces = [None if i in added else codec.token_bytes(i) for i in range(codec.vocab_size)]
        return cls(
            pieces, eos_ids, vocab_size, lambda text: codec.encode_text(text.decode("utf-8", "replace"))
        )

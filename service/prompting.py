"""Prompts -> token ids at the HTTP edge, off the event loop, refusing what cannot fit first.

Owns: :class:`PromptEncoder` (a plain prompt, or chat messages through the chat template, to
token ids) and :func:`chars_per_token_bound`. Tokenising runs in Starlette's thread pool, so
the event loop goes on answering ``/health`` and streaming other requests while a long prompt
is rendered and encoded. Before that, a text longer than ``context_window`` times the most
characters one token can stand for is refused with 400 ``context_length_exceeded``: it needs
more tokens than the window holds, whatever the tokenizer makes of it. The bound is taken
from the tokenizer itself (its longest vocabulary entry) and only where it provably holds:
tokenizers that may delete or fold text (a whitespace-dropping pre-tokenizer, a ``Replace``
that shrinks, a model whose unknown token can absorb a run of characters) get no bound and
are simply tokenised. Knows nothing about the engine or sampling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from evospec.tokenizer import TextCodec
from service.context import ServedModel
from service.errors import APIError

# Unicode normalisation composes at most 4 code points into one (e.g. U+1F85 from alpha + 3 marks).
_NORMALIZERS = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Prepend": 1, "Lowercase": 1}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


@dataclass(frozen=True)
class PromptEncoder:
    codec: TextCodec
    context_window: int
    max_chars: int | None  # texts longer than this cannot fit the window; None: no sound bound

    @classmethod
    def for_model(cls, model: ServedModel) -> PromptEncoder:
        per_token = chars_per_token_bound(model.codec)
        bound = None if per_token is None else model.context_window * per_token
        return cls(model.codec, model.context_window, bound)

    async def prompt(self, text: str) -> list[int]:
        """Ids of a completions prompt (with the tokenizer's special tokens, e.g. BOS)."""
        self._check_length(text, "prompt")
        return await run_in_threadpool(self.codec.encode, text)

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of ``messages`` rendered with the chat template, ready for the assistant's turn."""
        return await run_in_threadpool(self._chat, messages)

    def _chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            text = self.codec.render_chat(messages)
        except TemplateError as exc:
            raise APIError.bad_request(
                f"the chat template refused these messages: {exc}", param="messages"
            ) from None
        self._check_length(text, "messages")
        return self.codec.encode_text(text)

    def _check_length(self, text: str, param: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            what = "prompt" if param == "prompt" else "rendered chat"
            raise APIError.bad_request(
                f"This model's maximum context length is {self.context_window} tokens; the {what} has "
                f"{len(text)} characters, and more than {self.max_chars} cannot fit in that many tokens",
                param=param,
                code="context_length_exceeded",
            )


def chars_per_token_bound(codec: TextCodec) -> int | None:
    """The most characters of input one token can account for, or None where no bound holds.

    Each token covers at most as many characters as its vocabulary entry has (byte-level
    entries spell one byte per character, SentencePiece entries one character per character,
    byte-fallback entries like ``<0xE2>`` cover one byte with six), provided nothing between
    the text and the model drops or folds characters.
    """
    tok = codec.tok
    factor = _normalizer_factor(_state(tok.normalizer))
    if factor is None or not _keeps_characters(_state(tok.pre_tokenizer)):
        return None
    model = tok.model
    if type(model).__name__ != "BPE" or (model.unk_token and model.fuse_unk and not model.byte_fallback):
        return None  # WordPiece / Unigram unknowns, or fused unknown runs, stand for many characters
    longest = max((len(t) for t in tok.get_vocab(with_added_tokens=True)), default=0)
    return longest * factor if longest else None


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(spec: dict[str, Any] | None) -> int | None:
    """How many input characters may become one after normalisation (None: unbounded)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        if "String" not in pattern or len(spec.get("content", "")) < len(pattern["String"]):
            return None  # a regex, or a replacement that shrinks the text
        return 1
    return _NORMALIZERS.get(kind)


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    """True when the pre-tokenizer passes every character on (splits but never drops)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    return kind in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"

"""Text <-> token ids at the edge of the engine: tokenizer and chat template of one model.

Owns: a Hugging Face fast tokenizer loaded from the same source as the weights, the chat
template, and incremental detokenisation for streaming. The decoding engine never imports
this module; it sees token ids only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TextCodec:
    """Encode prompts (plain or chat) and decode generated ids.

    Reads a ``tokenizers`` JSON file and a Jinja chat template directly (no transformers
    import on the serving path: loading stays well under a second).
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        special: dict[str, str | None],
        stop_tokens: tuple[str, ...] = (),
    ) -> None:
        self.tok = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special = special  # "bos_token" / "eos_token" -> text
        self.stop_tokens = stop_tokens  # end generation besides EOS (e.g. Gemma's <end_of_turn>)
        self._template = None
        self._pieces: _TokenPieces | None = None  # built at the first token_bytes call

    @classmethod
    def from_folder(cls, folder: str | Path) -> TextCodec:
        from tokenizers import Tokenizer

        folder = Path(folder)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        conf_path = folder / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        template = conf.get("chat_template")
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()
        special = {k: _token_text(conf.get(k)) for k in ("bos_token", "eos_token")}
        return cls(tok, template, special, tuple(conf.get("stop_tokens", ())))

    @classmethod
    def from_gguf(cls, path: str | Path) -> TextCodec:
        """Tokenizer embedded in a GGUF file (via transformers' GGUF tokenizer reader)."""
        import tempfile

        from transformers import AutoTokenizer

        path = Path(path)
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            return cls.from_folder(tmp)

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.tok.save(str(folder / "tokenizer.json"))
        conf: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special}
        if self.stop_tokens:
            conf["stop_tokens"] = list(self.stop_tokens)
        (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
        if self.chat_template:
            (folder / "chat_template.jinja").write_text(self.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tok.token_to_id(text)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """EOS, then the stop tokens, as ids (tokens unknown to the vocabulary are left out)."""
        ids = (self.token_id(t) for t in (self.special.get("eos_token"), *self.stop_tokens))
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (e.g. an assistant turn's body)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=True, **{k: v or "" for k, v in self.special.items()}
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template, ready to answer."""
        return self.tok.encode(self.render_chat(messages), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for -- part of a character where a byte-level BPE or a
        byte-fallback token splits one -- and an added (special) token's own text, as the API's
        ``logprobs`` report it."""
        if self._pieces is None:
            self._pieces = _TokenPieces(self.tok)
        return self._pieces.bytes_of(token)

    @property
    def added_ids(self) -> tuple[int, ...]:
        """The added tokens' ids (the chat template's and the model's special tokens)."""
        return tuple(self.tok.get_added_tokens_decoder())

    def token_text(self, token: int) -> str:
        """:meth:`token_bytes` as text (a split character's bytes as U+FFFD)."""
        return self.token_bytes(token).decode("utf-8", errors="replace")


class _TokenPieces:
    """Token id -> bytes, by the tokenizer's decoder: byte-level BPE (GPT-2's printable
    stand-ins for bytes, reversed), SentencePiece pieces (``<0xNN>`` byte fallback, ``▁`` for a
    space), otherwise the token decoded alone."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}
        decoder = json.loads(tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self.byte_level = "ByteLevel" in kinds
        self.pieces = "ByteFallback" in kinds or "Metaspace" in kinds
        self.unbyte = _byte_stand_ins() if self.byte_level else {}

    def bytes_of(self, token: int) -> bytes:
        if token in self.added:
            return self.added[token].encode()
        piece = self.tok.id_to_token(token)
        if piece is None:
            raise ValueError(f"token id {token} is outside the vocabulary")
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        if self.pieces:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([token], skip_special_tokens=False).encode()


def _byte_stand_ins() -> dict[str, int]:
    """Byte-level BPE's vocabulary writes byte b as chr(b) where that is printable (33-126,
    161-172, 174-255) and the others, in order, as chr(256), chr(257), ...: the reverse map."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as a dict
        return v.get("content")
    return v


def _compile_template(source: str):
    """Jinja environment as chat templates expect it (trimmed blocks, raise_exception)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(source)


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters.

    Decodes only a short window per push: the text of ids[prefix:] minus the text of
    ids[prefix:read], where ``read`` marks the ids already emitted (the usual offset scheme,
    which keeps tokenizers' context-dependent spacing right). Linear in the output length.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # window start: ids before it are settled
        self._read = 0  # ids already turned into emitted text

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self.codec.decode(self.ids[self._prefix : self._read])
        text = self.codec.decode(self.ids[self._prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):  # incomplete UTF-8: wait for more ids
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included (as U+FFFD)."""
        before = self.codec.decode(self.ids[self._prefix : self._read])
        text = self.codec.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(before) :]

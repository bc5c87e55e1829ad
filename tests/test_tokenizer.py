"""TextCodec and IncrementalDecoder on the default model, checked against transformers' tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evospec.models.loading import LoadedModel
from evospec.tokenizer import IncrementalDecoder, TextCodec

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé and emoji 🎉, 中文 too"},
    ],
]

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nand new\n\nlines  ",
    "Ünïcödé, emoji 🎉👍🏽 and 中文字符 and ①②③",
    "def f(x):\n    return x ** 2  # code",
    "<|im_start|>user\nliteral special tokens<|im_end|>",
]


@pytest.fixture(scope="module")
def codec(default_model: LoadedModel) -> TextCodec:
    assert default_model.codec is not None
    return default_model.codec


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_rendering_matches_transformers(
    messages: list[dict[str, str]], codec: TextCodec, hf_default_tokenizer: Any
) -> None:
    expected = hf_default_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert codec.render_chat(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")
    ids = hf_default_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert codec.encode_chat(messages) == ids


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(
    text: str, codec: TextCodec, hf_default_tokenizer: Any
) -> None:
    ids = codec.encode(text)
    assert ids == hf_default_tokenizer(text)["input_ids"]
    if "<|im_start|>" not in text:  # special tokens are skipped on decode
        assert codec.decode(ids) == text


def test_special_tokens(codec: TextCodec) -> None:
    assert codec.vocab_size == 49152
    assert codec.token_id("<|im_end|>") == 2
    assert codec.eos_ids == (2,)
    assert codec.token_id(None) is None
    assert codec.decode([codec.token_id("<|im_start|>"), *codec.encode("hi"), 2]) == "hi"


@pytest.mark.parametrize("text", TEXTS[:3])
def test_incremental_decoder_pieces_concatenate_to_full_decode(text: str, codec: TextCodec) -> None:
    ids = codec.encode(text)
    detok = IncrementalDecoder(codec)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == codec.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    if "🎉" in text:  # byte-level BPE splits the emoji: some pushes must wait for more bytes
        assert "" in pieces


def test_incremental_decoder_with_chunks(codec: TextCodec) -> None:
    ids = codec.encode(TEXTS[2] + " " + TEXTS[3])
    detok = IncrementalDecoder(codec)
    pieces = [detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(pieces) == codec.decode(ids)


def test_save_and_reload(codec: TextCodec, tmp_path: Path) -> None:
    codec.save(tmp_path)
    again = TextCodec.from_folder(tmp_path)
    assert again.render_chat(CONVERSATIONS[1]) == codec.render_chat(CONVERSATIONS[1])
    assert again.encode(TEXTS[2]) == codec.encode(TEXTS[2])
    assert again.eos_ids == codec.eos_ids


def test_no_chat_template_raises(codec: TextCodec) -> None:
    bare = TextCodec(codec.tok, None, {"bos_token": None, "eos_token": None})
    assert not bare.has_chat_template and bare.eos_ids == ()
    with pytest.raises(ValueError, match="no chat template"):
        bare.render_chat(CONVERSATIONS[0])


@pytest.mark.slow
def test_codec_from_gguf_equals_converted_folder(codec: TextCodec) -> None:
    from evospec.models.registry import DEFAULT_MODEL, REGISTRY, package_files

    from_gguf = TextCodec.from_gguf(package_files(REGISTRY[DEFAULT_MODEL])[0])
    for messages in CONVERSATIONS:
        assert from_gguf.encode_chat(messages) == codec.encode_chat(messages)
    for text in TEXTS:
        assert from_gguf.encode(text) == codec.encode(text)


def test_incremental_decoder_flush_returns_the_incomplete_tail(codec: TextCodec) -> None:
    ids = codec.encode("party 🎉")
    detok = IncrementalDecoder(codec)
    text = "".join(detok.push([i]) for i in ids[:-1])  # stop inside the emoji's bytes
    tail = detok.flush()
    assert text + tail == codec.decode(ids[:-1]) and tail.endswith("\ufffd")
    assert detok.flush() == "" and detok.push([ids[-1]]) == ""  # nothing pending


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_spell_the_text_token_by_token(text: str, codec: TextCodec) -> None:
    """Byte-level BPE: a token may hold part of a character; its bytes are that part."""
    ids = codec.encode_text(text)
    assert b"".join(codec.token_bytes(i) for i in ids) == text.encode()
    split = [i for i in ids if codec.token_text(i).endswith("\ufffd")]
    if "🎉" in text:
        assert split  # the emoji's bytes span several tokens
    assert codec.token_text(codec.token_id("<|im_end|>")) == "<|im_end|>"  # special tokens: their text


def test_token_bytes_of_sentencepiece_pieces_and_byte_fallback() -> None:
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "▁hi": 1, "<0xE4>": 2, "<0xB8>": 3, "<0xAD>": 4, "a": 5}
    tok = Tokenizer(BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    codec = TextCodec(tok, None, {})
    assert codec.token_bytes(1) == b" hi"
    assert b"".join(codec.token_bytes(i) for i in (2, 3, 4)) == "中".encode()
    assert codec.token_text(2) == "\ufffd" and codec.token_text(5) == "a"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        codec.token_bytes(99)

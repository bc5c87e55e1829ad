"""TextCodec extras for GGUFs that lack them: Gemma's chat template and extra stop tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from evospec.models.loading import LoadedModel
from evospec.models.registry import GEMMA_CHAT_TEMPLATE, REGISTRY, _add_tokenizer_extras
from evospec.tokenizer import TextCodec


def _gemma_codec() -> TextCodec:
    return TextCodec(None, GEMMA_CHAT_TEMPLATE, {"bos_token": "<bos>", "eos_token": "<eos>"})


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [{"role": "user", "content": " Hi! "}],
            "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n",
        ),
        (
            [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3?"},
            ],
            "<bos><start_of_turn>user\nBe terse.\n\n2+2?<end_of_turn>\n"
            "<start_of_turn>model\n4<end_of_turn>\n"
            "<start_of_turn>user\n3+3?<end_of_turn>\n<start_of_turn>model\n",
        ),
    ],
)
def test_gemma_template_renders_the_turn_format(messages: list[dict[str, str]], expected: str) -> None:
    assert _gemma_codec().render_chat(messages) == expected


def test_gemma_template_agrees_with_transformers_renderer() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=GEMMA_CHAT_TEMPLATE,
        add_generation_prompt=True,
        bos_token="<bos>",
        eos_token="<eos>",
    )
    assert _gemma_codec().render_chat(messages) == rendered[0]


def test_gemma_template_refuses_non_alternating_roles() -> None:
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="alternate"):
        _gemma_codec().render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_stop_tokens_survive_save_and_extend_eos_ids(default_model: LoadedModel, tmp_path: Path) -> None:
    base = default_model.codec
    assert base is not None
    codec = TextCodec(base.tok, base.chat_template, base.special, ("<|im_start|>", "<not-a-token>"))
    start = base.token_id("<|im_start|>")
    assert codec.eos_ids == (*base.eos_ids, start)  # unknown stop tokens are left out
    codec.save(tmp_path)
    assert TextCodec.from_folder(tmp_path).eos_ids == codec.eos_ids


def test_registry_extras_write_template_and_stop_tokens(default_model: LoadedModel, tmp_path: Path) -> None:
    assert default_model.codec is not None
    TextCodec(default_model.codec.tok, None, default_model.codec.special).save(tmp_path)
    _add_tokenizer_extras(REGISTRY["gemma3-270m"], tmp_path)
    loaded = TextCodec.from_folder(tmp_path)
    assert loaded.chat_template == GEMMA_CHAT_TEMPLATE and loaded.stop_tokens == ("<end_of_turn>",)

"""Tiny models, tokenizers and corpora for the index tests (no real model, no shared data)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evospec.models.transformer import Transformer
from evospec.tokenizer import TextCodec
from tests.decoding.spec_helpers import tiny_target

CORPUS = (
    "The cat sat on the mat. The cat ate the rat.\n\n"
    "A dog sat on the log. The dog saw the cat.\n\n"
    "The rat ran to the mat and the cat ran after the rat.\n\n"
    "Der Hund schläft unter dem Tisch. The dog sleeps under the table."
)


def tiny_codec(texts: list[str], vocab_size: int = 300) -> TextCodec:
    """A byte-level BPE trained on ``texts`` (a few hundred ids), wrapped as a codec."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return TextCodec(tok, None, {"bos_token": None, "eos_token": None})


def tiny_model_for(codec: TextCodec, seed: int = 0) -> Transformer:
    return tiny_target(seed, vocab=codec.vocab_size)


def write_model_folder(folder: Path, model: Transformer, codec: TextCodec) -> Path:
    """A Hugging Face style folder that ``load_model`` reads (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_hf_dict()))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("rope")}
    save_file(state, str(folder / "model.safetensors"))
    codec.save(folder)
    return folder


def random_docs(n: int, vocab: int, seed: int = 0, max_len: int = 40) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len, (n,), generator=gen)
    return [torch.randint(0, vocab, (int(k),), generator=gen) for k in lens]

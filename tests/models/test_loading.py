"""Model loading from Hugging Face folders (plain and sharded) and GGUF, with clear file errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evospec.models.errors import CheckpointError
from evospec.models.loading import LoadedModel, load_model, read_hf_folder
from evospec.models.packing import PackedLinear, packing_available
from tests.conftest import FAMILIES, TinyPair, full_forward, hf_logits, random_tokens, tiny_models

TOL = 1e-4
PACKED_TOL = 5e-4  # oneDNN-packed linears vs transformers' dense ones (logits of magnitude ~20)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TinyPair, Path]]:
    """Every family saved with transformers' save_pretrained (safetensors)."""
    out = {}
    for family in FAMILIES:
        pair = tiny_models(family, seed=41)
        folder = tmp_path_factory.mktemp(f"hf-{family}")
        pair.hf.save_pretrained(str(folder))
        out[family] = (pair, folder)
    return out


def _assert_matches(loaded: LoadedModel, pair: TinyPair) -> None:
    tokens = random_tokens(16, seed=42)
    assert (full_forward(loaded.model, tokens) - hf_logits(pair.hf, tokens)).abs().max() <= TOL


def test_a_quantised_target_streams_its_weights(saved: dict[str, tuple[TinyPair, Path]]) -> None:
    from evospec.models.quant import QuantLinear, kernels_available

    if not kernels_available("int8"):
        pytest.skip("torch without the int8 CPU kernel")
    loaded = load_model(saved["llama"][1], weights="int8", progress=False)
    quant = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert quant and all(m.matmul.stream for m in quant)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_loads_and_matches(family: str, saved: dict[str, tuple[TinyPair, Path]]) -> None:
    pair, folder = saved[family]
    loaded = load_model(folder, progress=False)
    assert loaded.source == folder and loaded.name == folder.name
    assert loaded.codec is None  # no tokenizer.json in the folder
    assert loaded.model.cfg == pair.cfg
    assert not loaded.model.training
    if pair.cfg.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_matches(loaded, pair)


def test_sharded_hf_folder_loads_and_matches(tmp_path: Path) -> None:
    pair = tiny_models("qwen2", seed=43)
    pair.hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_matches(load_model(tmp_path, progress=False), pair)


def test_dtype_argument(saved: dict[str, tuple[TinyPair, Path]]) -> None:
    _, folder = saved["llama"]
    model = load_model(folder, dtype=torch.bfloat16, progress=False).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cache = model.new_cache(4)
    assert cache.k.dtype == torch.bfloat16
    out = model(random_tokens(4), torch.arange(4), cache)
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.logits).all()


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_prefixes_are_stripped(
    prefix: str, saved: dict[str, tuple[TinyPair, Path]], tmp_path: Path
) -> None:
    pair, folder = saved["gemma3"]
    state = load_file(str(folder / "model.safetensors"))
    save_file(
        {prefix + k.removeprefix("model."): v for k, v in state.items()}, str(tmp_path / "model.safetensors")
    )
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))
    _assert_matches(load_model(tmp_path, progress=False), pair)


# -- errors name the file and the problem -------------------------------------------------------------
def test_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match="no such file or folder") as info:
        load_model(path, progress=False)
    assert info.value.path == path and str(path) in str(info.value)


def test_unrecognised_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="expected a model folder") as info:
        load_model(path, progress=False)
    assert str(path) in str(info.value)


def test_missing_config_json(saved: dict[str, tuple[TinyPair, Path]], tmp_path: Path) -> None:
    shutil.copy(saved["llama"][1] / "model.safetensors", tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        load_model(tmp_path, progress=False)
    assert info.value.path == tmp_path / "config.json"


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="invalid config") as info:
        load_model(tmp_path, progress=False)
    assert info.value.path == tmp_path / "config.json"


def test_no_safetensors(saved: dict[str, tuple[TinyPair, Path]], tmp_path: Path) -> None:
    shutil.copy(saved["llama"][1] / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors") as info:
        load_model(tmp_path, progress=False)
    assert info.value.path == tmp_path


def test_unknown_architecture_names_the_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10})
    )
    with pytest.raises(ValueError, match="gpt2") as info:
        load_model(tmp_path, progress=False)
    assert str(tmp_path / "config.json") in str(info.value)


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10})
    )
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*GPT2LMHeadModel"):
        load_model(tmp_path, progress=False)


def test_truncated_safetensors(saved: dict[str, tuple[TinyPair, Path]], tmp_path: Path) -> None:
    src = saved["llama"][1]
    shutil.copy(src / "config.json", tmp_path)
    data = (src / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_model(tmp_path, progress=False)
    assert info.value.path == tmp_path / "model.safetensors"


def test_missing_shard(tmp_path: Path) -> None:
    pair = tiny_models("llama", seed=44)
    pair.hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing") as info:
        read_hf_folder(tmp_path)
    assert info.value.path == shard


def test_weights_not_matching_config(saved: dict[str, tuple[TinyPair, Path]], tmp_path: Path) -> None:
    src = saved["llama"][1]
    shutil.copy(src / "model.safetensors", tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match="missing") as info:
        load_model(tmp_path, progress=False)
    assert info.value.path == tmp_path and "layers.3" in str(info.value)


# -- the real default model -----------------------------------------------------------------------------
def test_default_model_matches_transformers(default_model: LoadedModel, hf_default) -> None:
    """Dense weights: within 1e-4 of transformers. Packed (the default): other GEMM kernels, so
    a little more rounding, still far below any logit gap that decides a token."""
    from evospec.models.registry import DEFAULT_MODEL

    ids = torch.tensor([default_model.codec.encode("The capital of France is Paris, and the capital of")])
    with torch.inference_mode():
        ref = hf_default(input_ids=ids).logits
    dense = load_model(DEFAULT_MODEL, progress=False, pack=False).model
    assert not any(isinstance(m, PackedLinear) for m in dense.modules())
    assert (full_forward(dense, ids) - ref).abs().max() <= TOL
    assert isinstance(default_model.model.lm_head, PackedLinear) == packing_available(dense.lm_head.weight)
    assert (full_forward(default_model.model, ids) - ref).abs().max() <= PACKED_TOL


@pytest.mark.slow
def test_gguf_loaded_by_transformers_matches_ours(default_model: LoadedModel) -> None:
    """The packaged GGUF read by transformers' own GGUF loader vs ours (load_model on the .gguf)."""
    from transformers import AutoModelForCausalLM

    from evospec.models.registry import DEFAULT_MODEL, REGISTRY, package_files

    gguf_path = package_files(REGISTRY[DEFAULT_MODEL])[0]
    ours = load_model(gguf_path, progress=False, pack=False)  # the loader's parity, not the kernels'
    assert ours.name == gguf_path.stem and ours.codec is not None
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    codec = default_model.codec
    prompts = [
        codec.encode("Once upon a time, in a land far away,"),
        codec.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
        codec.encode("def fibonacci(n):\n    " * 8),
    ]
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            expected = ref(input_ids=x).logits
        assert (full_forward(ours.model, x) - expected).abs().max() <= TOL
        assert (full_forward(default_model.model, x) - expected).abs().max() <= PACKED_TOL

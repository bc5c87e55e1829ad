"""EAGLE-3 heads: the public checkpoint layout, bit-exact round trips, fitting the target."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from evospec.models.eagle import load_head
from evospec.models.eagle3 import (
    ARCHITECTURE,
    Eagle3Head,
    default_aux_layers,
    load_eagle3,
    new_eagle3_for,
    save_eagle3,
)
from evospec.models.errors import CheckpointError
from tests.decoding.spec_helpers import prompt_of, tiny_target

PUBLIC_KEYS = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
}


def _public_checkpoint(folder, target, draft_vocab: int | None, seed: int = 0):
    """A head written by hand with exactly the public names, shapes and config fields."""
    tc = target.cfg
    d, hd, v = tc.hidden_size, tc.head_dim, tc.vocab_size
    vd = draft_vocab or v
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "fc.weight": (d, 3 * d),
        "midlayer.self_attn.q_proj.weight": (tc.num_heads * hd, 2 * d),
        "midlayer.self_attn.k_proj.weight": (tc.num_kv_heads * hd, 2 * d),
        "midlayer.self_attn.v_proj.weight": (tc.num_kv_heads * hd, 2 * d),
        "midlayer.self_attn.o_proj.weight": (d, tc.num_heads * hd),
        "midlayer.mlp.gate_proj.weight": (tc.intermediate_size, d),
        "midlayer.mlp.up_proj.weight": (tc.intermediate_size, d),
        "midlayer.mlp.down_proj.weight": (d, tc.intermediate_size),
        "lm_head.weight": (vd, d),
    }
    state = {k: (torch.randn(s, generator=g) * 0.2).half() for k, s in shapes.items()}
    for k in (
        "midlayer.input_layernorm",
        "midlayer.hidden_norm",
        "midlayer.post_attention_layernorm",
        "norm",
    ):
        state[f"{k}.weight"] = (1 + 0.1 * torch.randn(d, generator=g)).half()
    if vd < v:
        ids = torch.randperm(v, generator=g)[:vd].sort().values
        state["d2t"] = ids - torch.arange(vd)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    config = {
        "architectures": [ARCHITECTURE],
        "hidden_size": d,
        "intermediate_size": tc.intermediate_size,
        "num_attention_heads": tc.num_heads,
        "num_key_value_heads": tc.num_kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": tc.rope_theta,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return state


@pytest.mark.parametrize("draft_vocab", [None, 24])
def test_the_public_layout_loads_unchanged(tmp_path, draft_vocab):
    target = tiny_target(0)
    state = _public_checkpoint(tmp_path / "h", target, draft_vocab)
    head = load_head(tmp_path / "h", target)
    assert isinstance(head, Eagle3Head)
    assert head.aux_layers == default_aux_layers(target.cfg.num_layers)
    own = head.state_dict()
    for k, v in state.items():
        assert torch.equal(own[k].to(v.dtype), v), k
    assert set(own) >= PUBLIC_KEYS
    if draft_vocab:
        ids = head.draft_ids()
        assert torch.equal(ids, torch.arange(draft_vocab) + state["d2t"]) and head.t2d[ids].all()
    else:
        assert head.draft_ids() is None and head.d2t is None
    head.attach(target)
    h = head(
        torch.randn(1, 3, 3 * target.cfg.hidden_size),
        torch.tensor([[1, 2, 3]]),
        torch.arange(3),
        head.new_cache(8),
        None,
    )
    assert h.shape == (1, 3, target.cfg.hidden_size)
    assert head.lm_head(head.logit_input(h)).shape[-1] == (draft_vocab or target.cfg.vocab_size)


@pytest.mark.parametrize("draft_vocab", [None, 20])
def test_save_load_round_trip_is_bit_exact(tmp_path, draft_vocab):
    target = tiny_target(1)
    ids = None if draft_vocab is None else torch.tensor(prompt_of(2, 60)).unique()[:draft_vocab]
    head = new_eagle3_for(target, seed=3, draft_ids=ids)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.half().float())  # weights fp16 can hold: the file is fp16
    save_eagle3(head, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["architectures"] == [ARCHITECTURE] and raw["evospec_aux_layers"] == list(head.aux_layers)
    back = load_eagle3(tmp_path / "h")
    for (k, a), (k2, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    x = torch.randn(1, 4, 3 * target.cfg.hidden_size)
    tok, pos = torch.tensor([prompt_of(1, 4)]), torch.arange(4)
    back.attach(target)
    assert torch.equal(head(x, tok, pos, head.new_cache(8), None), back(x, tok, pos, back.new_cache(8), None))


def test_fc_runs_only_on_target_features():
    target = tiny_target(2)
    head = new_eagle3_for(target)
    d = target.cfg.hidden_size
    own = torch.randn(2, d)
    assert torch.equal(head.fuse(own), own)
    assert head.fuse(torch.randn(2, 3 * d)).shape == (2, d)


def test_a_head_that_does_not_fit_is_a_clear_error(tmp_path):
    target = tiny_target(0)
    _public_checkpoint(tmp_path / "h", target, None)
    head = load_eagle3(tmp_path / "h", target_layers=2)
    other = tiny_target(0, vocab=80)
    with pytest.raises(ValueError, match="vocab_size"):
        head.attach(other)
    far = Eagle3Head(head.cfg, (0, 1, 7))
    with pytest.raises(ValueError, match="aux layers"):
        far.attach(target)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": 10}))
    with pytest.raises(CheckpointError, match="draft_vocab_size"):
        load_eagle3(tmp_path / "h", target_layers=2)


def test_a_reduced_vocabulary_without_d2t_is_refused(tmp_path):
    target = tiny_target(0)
    _public_checkpoint(tmp_path / "h", target, 24)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    state.pop("d2t")
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t"):
        load_eagle3(tmp_path / "h", target_layers=2)


def test_a_tied_head_drafts_through_the_target_lm_head_and_saves_without_it(tmp_path):
    target = tiny_target(4)
    head = new_eagle3_for(target, tied=True)
    assert head.lm_head is target.lm_head and "lm_head.weight" not in head.state_dict()
    save_eagle3(head, tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    assert raw["tie_word_embeddings"] is True
    back = load_head(tmp_path / "h", target).attach(target)
    assert back.tied and back.lm_head is target.lm_head and back.draft_ids() is None
    twin = back.clone()
    assert twin.lm_head is target.lm_head
    x = torch.randn(1, 2, 3 * target.cfg.hidden_size)
    tok = torch.tensor([[1, 2]])
    assert torch.allclose(
        back(x, tok, torch.arange(2), back.new_cache(4), None),
        head(x, tok, torch.arange(2), head.new_cache(4), None),
        atol=1e-2,
    )


def test_an_eagle3_head_given_as_an_eagle2_one_is_a_clear_error(tmp_path):
    from evospec.models.eagle import load_eagle

    _public_checkpoint(tmp_path / "h", tiny_target(0), None)
    with pytest.raises(CheckpointError, match="--draft3"):
        load_eagle(tmp_path / "h")


def test_an_eagle2_head_given_as_an_eagle3_one_is_a_clear_error(tmp_path):
    from evospec.models.eagle import new_eagle_for, save_eagle

    target = tiny_target(0)
    save_eagle(new_eagle_for(target), tmp_path / "h2")
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head"):
        load_eagle3(tmp_path / "h2", target_layers=2)

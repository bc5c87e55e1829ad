"""EAGLE-3 draft head: three target layers fused by ``fc``, one decoder layer on [embedding, feature].

Owns: the module and its public checkpoint layout (SafeAILab/EAGLE ``traineagle3``, as SGLang
and vLLM load it): ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, the usual Llama fields) plus ``model.safetensors`` or
``pytorch_model.bin`` with the keys ``fc.weight`` [D, 3 D_t], ``midlayer.self_attn.{q,k,v}_proj
.weight`` [*, 2 D], ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj
.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``norm.weight``, ``lm_head.weight`` [V_d, D] (absent with ``tie_word_embeddings``: the
target's LM head, full vocabulary), and with a reduced draft vocabulary ``d2t`` [V_d]
int64 (target id = draft id + d2t[draft id]) and ``t2d`` [V] bool. The token embedding is the
target's (published heads do not carry it); one in the checkpoint is used instead.

One step, for a feature h (the fused target layers at the first step, else the head's own
previous output) and the embedding e of the token after it:

    h = fc(cat[low, mid, high])                       # only for target features (width 3 D_t)
    x = cat[input_layernorm(e), hidden_norm(h)]       # [.., 2 D]
    h = h + o_proj(attention(x))                      # q/k/v read 2 D
    h = h + mlp(post_attention_layernorm(h))          # the next step's feature (pre-norm)
    logits = lm_head(norm(h))                         # over the draft vocabulary

Aux layers: ``aux_layers`` are target layer indices whose *outputs* are fused (what
``Transformer.forward(aux_layers=...)`` returns). EAGLE's default -- the inputs of layers 2,
L/2 and L-3 -- is the outputs of layers 1, L/2 - 1 and L - 4 (:func:`default_aux_layers`).
A config may name them as ``eagle_config.eagle_aux_hidden_state_layer_ids`` (SGLang's reading:
layer outputs, ids + 1 are inputs); we write and read ours as ``evospec_aux_layers`` (outputs).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from evospec.models.config import ModelConfig
from evospec.models.eagle import EagleHead, _read_weights, draft_config, random_init
from evospec.models.errors import CheckpointError
from evospec.models.kv_cache import KVCache
from evospec.models.rope import RotaryTable
from evospec.models.transformer import MLP, Attention, RMSNorm, Transformer

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE's low / middle / high layers for an ``num_layers``-layer target, as layer outputs
    (clamped into the model for targets of fewer than 5 layers)."""
    last = num_layers - 1
    return (min(1, last), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0))


class Eagle3Layer(nn.Module):
    """The draft's one decoder layer: attention over [normed embedding, normed feature]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # they read [embedding, feature]: 2 D
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * d, old.out_features, bias=False))
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, eps, 0.0)
        self.hidden_norm = RMSNorm(d, eps, 0.0)
        self.post_attention_layernorm = RMSNorm(d, eps, 0.0)

    def forward(self, emb, h, cos_sin, cache: KVCache, mask, rows=None) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)
        h = h + self.self_attn(x, cos_sin, cache, mask, rows)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft. ``forward`` returns pre-norm features; :meth:`logit_input` norms them
    for the LM head (``lm_head`` covers ``draft_ids``: the full vocabulary, or a reduced one)."""

    arch = "eagle3"
    regresses = False  # trained on the target's token distribution only (no feature loss)
    attention_path = "midlayer.self_attn"  # the draft layer's attention (CL-LoRA adapts its q/v)

    def __init__(
        self,
        cfg: ModelConfig,
        aux_layers: tuple[int, ...],
        *,
        target_hidden: int | None = None,
        draft_vocab: int | None = None,
        own_embedding: bool = False,
        tied: bool = False,
    ) -> None:
        super().__init__()
        if len(aux_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {list(aux_layers)}")
        self.cfg = cfg
        self.aux_layers = tuple(int(i) for i in aux_layers)
        d, dt = cfg.hidden_size, target_hidden or cfg.hidden_size
        vd = draft_vocab or cfg.vocab_size
        self.fc = nn.Linear(3 * dt, d, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, 0.0)
        self.tied = tied  # the LM head is the target's (tie_word_embeddings): not in the checkpoint
        if tied and vd < cfg.vocab_size:
            raise ValueError("a tied EAGLE-3 LM head covers the full vocabulary")
        if not tied:
            self.lm_head = nn.Linear(d, vd, bias=False)
        if vd < cfg.vocab_size:  # the public mapping buffers of a reduced draft vocabulary
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d) if own_embedding else None
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._shared: list[nn.Embedding] = []  # the target's embedding, kept out of state_dict
        self._shared_head: list[nn.Module] = []  # tied: the target's LM head, likewise

    @property
    def lm_head(self) -> nn.Module:
        """The draft's LM head: its own, or (tied) the target's, shared after :meth:`attach`."""
        own = self._modules.get("lm_head")
        if own is not None:
            return own
        if not self._shared_head:
            raise RuntimeError("a tied EAGLE-3 head has no LM head until attach(target)")
        return self._shared_head[0]

    @property
    def draft_vocab(self) -> int:
        return self.lm_head.out_features if not self.tied else self.cfg.vocab_size

    def draft_ids(self) -> torch.Tensor | None:
        """[V_d] target id of each LM-head row, or None when the head covers the full vocabulary."""
        if self.d2t is None:
            return None
        return torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t

    def attach(self, target: Transformer) -> Eagle3Head:
        """Check the head fits ``target`` (naming the field that does not) and share its embedding."""
        tc = target.cfg
        checks = [
            ("vocab_size", self.cfg.vocab_size, tc.vocab_size),
            ("fc input (3 x target hidden_size)", self.fc.in_features, 3 * tc.hidden_size),
        ]
        if self.embed_tokens is None:
            checks.append(
                ("hidden_size (the target embedding is shared)", self.cfg.hidden_size, tc.hidden_size)
            )
        for name, ours, theirs in checks:
            if ours != theirs:
                raise ValueError(
                    f"EAGLE-3 head does not fit the target: {name} is {ours}, the target has {theirs}"
                )
        bad = [i for i in self.aux_layers if not 0 <= i < tc.num_layers]
        if bad:
            layers = list(self.aux_layers)
            raise ValueError(f"EAGLE-3 head aux layers {layers} are outside the target's {tc.num_layers}")
        self._shared[:] = [target.embed_tokens]
        if self.tied:
            self._shared_head[:] = [target.lm_head]
        return self

    embedding = EagleHead.embedding  # its own embedding, else the target's shared by attach

    def new_cache(self, max_len: int) -> KVCache:
        p = self.norm.weight
        return KVCache(1, self.cfg.num_kv_heads, self.cfg.head_dim, max_len, dtype=p.dtype, device=p.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [.., 3 D_t] -> [.., D]; the head's own features pass through."""
        return self.fc(features) if features.shape[-1] == self.fc.in_features else features

    def forward(
        self,
        features: torch.Tensor,  # [B, n, 3 D_t] fused target layers, or [B, n, D] the head's own
        tokens: torch.Tensor,  # [B, n] the token after each feature's position
        positions: torch.Tensor,  # [n]
        cache: KVCache,
        mask: torch.Tensor | None,  # [n, cache.length + n] bool, or None for plain causal
    ) -> torch.Tensor:  # [B, n, D] pre-norm features: the next step's input
        h = self.step(features, tokens, positions, cache, mask)
        cache.advance(tokens.shape[1])
        return h

    def step(self, features, tokens, positions, cache, mask, rows=None) -> torch.Tensor:
        """:meth:`forward` without advancing the cache (what a recorded draft step runs; the
        feature width, 3 D_t or D, decides whether ``fc`` runs, so a recording is per width);
        ``rows``: chain rows attending row by row (``models/step.py``) instead of ``mask``."""
        h = self.fuse(features)
        emb = self.embedding()(tokens).to(h.dtype)
        return self.midlayer(emb, h, self.rope(positions, h.dtype), cache, mask, rows)

    def logit_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the final norm of the head's features."""
        return self.norm(h)

    def clone(self) -> Eagle3Head:
        """An independent copy of the head's own weights (sharing the target embedding)."""
        twin = Eagle3Head(
            self.cfg,
            self.aux_layers,
            target_hidden=self.fc.in_features // 3,
            draft_vocab=self.draft_vocab,
            own_embedding=self.embed_tokens is not None,
            tied=self.tied,
        )
        twin.load_state_dict(self.state_dict())
        twin._shared[:] = self._shared
        twin._shared_head[:] = self._shared_head
        return twin.to(self.norm.weight.device, self.norm.weight.dtype).eval()


# -- checkpoint format ----------------------------------------------------------------------------
def is_eagle3_config(raw: dict) -> bool:
    """True for an EAGLE-3 head's config.json (by its architecture name or draft vocabulary)."""
    return (
        any("eagle3" in str(a).lower() for a in raw.get("architectures") or ()) or "draft_vocab_size" in raw
    )


def _aux_from_config(raw: dict, num_layers: int | None) -> tuple[int, ...] | None:
    if "evospec_aux_layers" in raw:
        return tuple(raw["evospec_aux_layers"])
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) for i in ids)  # SGLang's reading: layer outputs
    return default_aux_layers(num_layers) if num_layers else None


def load_eagle3(
    path: str | Path,
    *,
    target_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Eagle3Head:
    """Load an EAGLE-3 head folder. ``target_layers`` sizes the default aux layers when the
    config names none (published heads: EAGLE's low/middle/high for that depth)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(cfg_path, "file not found (an EAGLE-3 head folder needs config.json)")
    raw = json.loads(cfg_path.read_text())
    raw.setdefault("model_type", "llama")
    raw["num_hidden_layers"] = 1
    cfg = replace(ModelConfig.from_hf_dict(raw), num_layers=1, attention_bias=False, qk_norm=False)
    state = {k.removeprefix("model."): v for k, v in _read_weights(folder).items()}
    tied = bool(raw.get("tie_word_embeddings")) and "lm_head.weight" not in state
    for key in ("fc.weight", "midlayer.self_attn.q_proj.weight") + (() if tied else ("lm_head.weight",)):
        if key not in state:
            raise CheckpointError(folder, f"not an EAGLE-3 head: no {key}")
    aux = _aux_from_config(raw, target_layers)
    if aux is None:
        raise CheckpointError(folder, "config.json names no aux layers and the target depth is unknown")
    vd = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    if tied and vd != cfg.vocab_size:
        raise CheckpointError(
            folder, f"a tied LM head covers the vocabulary ({cfg.vocab_size}), not {vd} ids"
        )
    if not tied and state["lm_head.weight"].shape[0] != vd:
        raise CheckpointError(
            folder, f"draft_vocab_size is {vd} but lm_head.weight has {state['lm_head.weight'].shape[0]} rows"
        )
    if vd < cfg.vocab_size and "d2t" not in state:
        raise CheckpointError(folder, f"a reduced draft vocabulary ({vd} < {cfg.vocab_size}) needs d2t")
    if vd == cfg.vocab_size:
        state.pop("d2t", None)
        state.pop("t2d", None)
    head = Eagle3Head(
        cfg,
        aux,
        target_hidden=state["fc.weight"].shape[1] // 3,
        draft_vocab=vd,
        own_embedding="embed_tokens.weight" in state,
        tied=tied,
    )
    if vd < cfg.vocab_size:
        _check_d2t(folder, state["d2t"], cfg.vocab_size)
        state.setdefault("t2d", _t2d_of(state["d2t"], cfg.vocab_size))
    cast = {k: (v if k in ("d2t", "t2d") else v.to(dtype)) for k, v in state.items()}
    missing, unexpected = head.load_state_dict(cast, strict=False)
    missing = [k for k in missing if not k.startswith("rope.")]
    if missing or unexpected:
        raise CheckpointError(
            folder, f"EAGLE-3 head keys do not match: missing {missing}, unexpected {unexpected}"
        )
    return head.to(device).eval()


def _check_d2t(folder: Path, d2t: torch.Tensor, vocab: int) -> None:
    ids = torch.arange(d2t.numel()) + d2t.long()
    if d2t.dtype not in (torch.int64, torch.int32) or (ids < 0).any() or (ids >= vocab).any():
        raise CheckpointError(folder, f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
    if ids.unique().numel() != ids.numel():
        raise CheckpointError(folder, "d2t maps two draft ids to one target id")


def _t2d_of(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(d2t.numel()) + d2t.long()] = True
    return t2d


def save_eagle3(head: Eagle3Head, path: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``head`` in the public EAGLE-3 layout (safetensors; floats in ``dtype``)."""
    from evospec.common import save_tensors

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    d = head.cfg.to_hf_dict()
    d.update(
        architectures=[ARCHITECTURE],
        num_hidden_layers=1,
        draft_vocab_size=head.draft_vocab,
        evospec_aux_layers=list(head.aux_layers),
        tie_word_embeddings=head.tied,
        torch_dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32"),
    )
    if head.fc.in_features != 3 * head.cfg.hidden_size:
        d["target_hidden_size"] = head.fc.in_features // 3
    (folder / "config.json").write_text(json.dumps(d, indent=2))
    state = {}
    for k, v in head.state_dict().items():
        if k.startswith("rope."):
            continue
        state[k] = (
            v.detach().to("cpu").contiguous()
            if k in ("d2t", "t2d")
            else v.detach().to("cpu", dtype).contiguous()
        )
    save_tensors(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def new_eagle3_for(
    target: Transformer,
    *,
    seed: int = 0,
    aux_layers: tuple[int, ...] | None = None,
    draft_ids: torch.Tensor | None = None,
    tied: bool = False,
) -> Eagle3Head:
    """A randomly initialised EAGLE-3 head for ``target``; its LM head starts from the target's
    rows (``draft_ids``: a reduced draft vocabulary of those target ids, sorted), or is the
    target's own (``tied``: frozen, not saved; a full-vocabulary head a third the size)."""
    tc = target.cfg
    cfg = draft_config(tc)
    ids = None if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.long).sort().values.cpu()
    head = Eagle3Head(
        cfg,
        aux_layers or default_aux_layers(tc.num_layers),
        draft_vocab=None if ids is None else len(ids),
        tied=tied,
    )
    random_init(head, seed)
    with torch.no_grad():
        if not tied:
            lm = _dense_lm_head(target).to("cpu")
            head.lm_head.weight.copy_(lm if ids is None else lm[ids])
        if ids is not None:
            head.d2t.copy_(ids - torch.arange(len(ids)))
            head.t2d.copy_(_t2d_of(head.d2t, tc.vocab_size))
    return head.to(target.device).attach(target).eval()


def _dense_lm_head(target: Transformer) -> torch.Tensor:
    w = getattr(target.lm_head, "weight", None)
    if w is None:
        w = target.embed_tokens.weight  # a quantised head keeps no dense copy: the tied embedding
    return w.detach().float()

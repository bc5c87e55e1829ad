"""EAGLE-2 draft head: fc(concat[embedding(token), target feature]) -> one decoder layer.

Owns: the draft module and its checkpoint format, which is the public EAGLE-1/2 layout
(``config.json`` + ``pytorch_model.bin`` or ``model.safetensors``; keys ``fc.weight``,
optional ``fc.bias``, ``layers.0.*`` without an input norm, optional ``embed_tokens.weight``),
so published heads for Llama-3.x / Qwen2 targets load unchanged. The LM head is the target's
(shared); so is the embedding unless the checkpoint carries its own.

Features are the target's final-layer hidden states *after* its final norm (what the
target's LM head consumes); the head's output goes straight into the LM head.
Knows nothing about trees or vocabularies; see ``decoding/drafter.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from evospec.models.config import ModelConfig
from evospec.models.errors import CheckpointError
from evospec.models.fused import run_fused_draft
from evospec.models.huge_pages import adopt_weights
from evospec.models.kv_cache import KVCache
from evospec.models.quant import quantize_linears
from evospec.models.rope import RotaryTable
from evospec.models.transformer import MLP, Attention, RMSNorm, Transformer


class DraftLayer(nn.Module):
    """A Llama-style decoder layer; EAGLE-2's first layer has no input norm."""

    def __init__(self, cfg: ModelConfig, input_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer=0)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 0.0)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, 0.0) if input_norm else None

    def forward(self, x, cos_sin, cache: KVCache, mask, rows=None) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, cos_sin, cache, mask, rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The draft backbone. ``forward`` returns draft features; logits come from a head fn."""

    arch = "eagle2"
    regresses = True  # trained to predict the target's next feature as well as its token
    attention_path = "layers.0.self_attn"  # the draft layer's attention (CL-LoRA adapts its q/v)
    aux_layers: tuple[int, ...] = ()  # reads the target's final features, no other layers
    fused_step = False  # chain steps as one draft_step op (models/fused.py: enable_fused_draft)

    def __init__(self, cfg: ModelConfig, *, fc_bias: bool = True, own_embedding: bool = False) -> None:
        super().__init__()
        if cfg.num_layers != 1:
            raise ValueError(f"EAGLE-2 heads have one decoder layer, config says {cfg.num_layers}")
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DraftLayer(cfg, input_norm=False)])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self._shared: list[nn.Embedding] = []  # the target's embedding; a list keeps it out of state_dict

    def attach(self, target: Transformer) -> EagleHead:
        """Share the target's embedding (when the head has none) after checking shapes."""
        tc = target.cfg
        if self.cfg.hidden_size != tc.hidden_size:
            raise ValueError(
                f"draft hidden size {self.cfg.hidden_size} != target hidden size {tc.hidden_size}"
            )
        if self.cfg.vocab_size != tc.vocab_size:
            raise ValueError(f"draft vocabulary {self.cfg.vocab_size} != target vocabulary {tc.vocab_size}")
        self._shared[:] = [target.embed_tokens]
        return self

    def embedding(self) -> nn.Embedding:
        emb = self.embed_tokens if self.embed_tokens is not None else (self._shared or [None])[0]
        if emb is None:
            raise RuntimeError("draft head has no embedding: call attach(target) first")
        return emb

    def new_cache(self, max_len: int) -> KVCache:
        p = self.layers[0].post_attention_layernorm.weight  # a norm stays dense in every weight format
        return KVCache(1, self.cfg.num_kv_heads, self.cfg.head_dim, max_len, dtype=p.dtype, device=p.device)

    def forward(
        self,
        features: torch.Tensor,  # [B, n, D] target (or draft-predicted) features
        tokens: torch.Tensor,  # [B, n] the token that follows each feature's position
        positions: torch.Tensor,  # [n]
        cache: KVCache,
        mask: torch.Tensor | None,  # [n, cache.length + n] bool, or None for plain causal/no prefix
    ) -> torch.Tensor:  # [B, n, D] draft features, fed to the LM head
        x = self.step(features, tokens, positions, cache, mask)
        cache.advance(tokens.shape[1])
        return x

    def step(self, features, tokens, positions, cache, mask, rows=None) -> torch.Tensor:
        """:meth:`forward` without advancing the cache (what a recorded draft step runs);
        ``rows``: chain rows attending row by row (``models/step.py``) instead of ``mask``.
        A fused int4 copy (``models/fused.py: enable_fused_draft``) runs a chain step -- one row,
        or rows without a mask -- as one op."""
        emb = self.embedding()(tokens).to(features.dtype)
        pairs = torch.cat((emb, features), dim=-1)
        if self.fused_step and mask is None and (rows is None or all(r.index is None for r in rows)):
            return run_fused_draft(self, pairs, positions, cache)
        x = self.fc(pairs)
        return self.layers[0](x, self.rope(positions, x.dtype), cache, mask, rows)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return features  # the target's final features are the input as they are

    def logit_input(self, h: torch.Tensor) -> torch.Tensor:
        return h  # the output goes straight into the (target's) LM head

    def clone(self) -> EagleHead:
        """An independent copy of the head's own weights (sharing the target embedding)."""
        twin = EagleHead(
            self.cfg, fc_bias=self.fc.bias is not None, own_embedding=self.embed_tokens is not None
        )
        twin.load_state_dict(self.state_dict())
        twin._shared[:] = self._shared
        return twin.to(self.fc.weight.device, self.fc.weight.dtype).eval()


# -- checkpoint format ----------------------------------------------------------------------------
def load_eagle(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> EagleHead:
    """Load an EAGLE-2 head folder (config.json + pytorch_model.bin or model.safetensors)."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(cfg_path, "file not found (an EAGLE head folder needs config.json)")
    raw = json.loads(cfg_path.read_text())
    from evospec.models.eagle3 import is_eagle3_config

    if is_eagle3_config(raw):
        raise CheckpointError(folder, "an EAGLE-3 head, not an EAGLE-2 one: give it as --draft3 (draft3:)")
    raw.setdefault("model_type", "llama")
    cfg = ModelConfig.from_hf_dict(raw)
    state = _read_weights(folder)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if "fc.weight" not in state:
        raise CheckpointError(folder, "not an EAGLE head: no fc.weight")
    cfg = replace(cfg, attention_bias="layers.0.self_attn.q_proj.bias" in state, qk_norm=False)
    head = EagleHead(cfg, fc_bias="fc.bias" in state, own_embedding="embed_tokens.weight" in state)
    missing, unexpected = head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if missing or unexpected:
        raise CheckpointError(
            folder, f"EAGLE head keys do not match: missing {missing}, unexpected {unexpected}"
        )
    return head.to(device).eval()


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    st, binf = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if binf.is_file():
            return torch.load(str(binf), map_location="cpu", weights_only=True)
    except Exception as exc:
        f = st if st.is_file() else binf
        raise CheckpointError(f, f"cannot read weights (truncated or corrupt?): {exc}") from exc
    raise CheckpointError(folder, "no model.safetensors or pytorch_model.bin")


def save_eagle(head: EagleHead, path: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``head`` in the EAGLE-2 format (safetensors, half precision by default)."""
    from evospec.common import save_tensors

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    d = head.cfg.to_hf_dict()
    d["num_hidden_layers"] = 1
    d["torch_dtype"] = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")
    (folder / "config.json").write_text(json.dumps(d, indent=2))
    state = {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in head.state_dict().items()
        if not k.startswith("rope.")
    }
    save_tensors(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def clone_head(head):
    """An independent copy of ``head``'s own weights, EAGLE-2 or EAGLE-3 (the shared target
    embedding is not copied)."""
    return head.clone()


def quantised_head(head, fmt: str = "int8"):
    """A copy of ``head`` whose linears run ``fmt`` kernels on the CPU (``models/quant.py``),
    for drafting only: no LoRA, no training. The draft only proposes tokens, so its format
    changes acceptance, never output. The copy shares the target embedding; an EAGLE-3 head's
    own LM head keeps its dense rows too (the reduced head gathers them)."""
    twin = clone_head(head)
    quantize_linears(twin, fmt, keep_dense=("lm_head",) if head.arch == "eagle3" else ())
    if next(twin.parameters()).device.type == "cpu":
        adopt_weights(twin)  # read cold every drafted round: in 2 MB pages where the kernel gives them
    return twin


def load_head(path: str | Path, target: Transformer | None = None, **kw):
    """Load an EAGLE-2 or EAGLE-3 head folder, telling them apart by config.json."""
    from evospec.models.eagle3 import is_eagle3_config, load_eagle3

    cfg_path = Path(path) / "config.json"
    if cfg_path.is_file():
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(cfg_path, f"not JSON: {exc}") from exc
        if is_eagle3_config(raw):
            return load_eagle3(
                path, target_layers=target.cfg.num_layers if target is not None else None, **kw
            )
    return load_eagle(path, **kw)


def draft_config(target_cfg: ModelConfig) -> ModelConfig:
    """A draft head's config for a target: its sizes, one plain Llama layer."""
    return replace(
        target_cfg,
        family="llama",
        num_layers=1,
        attention_bias=False,
        qk_norm=False,
        hidden_act="silu",
        sliding_window=None,
        layer_types=(),
        query_pre_attn_scalar=None,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def random_init(head: nn.Module, seed: int) -> None:
    """Matrices ~ N(0, 1 / fan_in), norms 1, the rest 0 (where training starts)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[1] ** 0.5))
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.zero_()


@torch.no_grad()
def widen_mlp(head: EagleHead, intermediate_size: int, *, seed: int = 0) -> EagleHead:
    """A copy of ``head`` whose layer's MLP has ``intermediate_size`` units: the old units keep
    their weights, the new ones start with random gate and up rows (as :func:`random_init`
    draws them) and zero down columns, so the copy computes exactly what ``head`` computes and
    training can grow into the new units (function-preserving growth, as Net2Net's). Raises
    ValueError unless it is wider than the head's MLP."""
    old, d = head.cfg.intermediate_size, head.cfg.hidden_size
    if intermediate_size <= old:
        raise ValueError(f"--widen-mlp {intermediate_size}: the head's MLP already has {old} units")
    wide = EagleHead(
        replace(head.cfg, intermediate_size=intermediate_size),
        fc_bias=head.fc.bias is not None,
        own_embedding=head.embed_tokens is not None,
    )
    gen = torch.Generator().manual_seed(seed)
    state = head.state_dict()
    for name in ("gate_proj", "up_proj"):
        key = f"layers.0.mlp.{name}.weight"  # [I, D]: new rows appended
        extra = torch.randn(intermediate_size - old, d, generator=gen) / d**0.5
        state[key] = torch.cat((state[key], extra.to(state[key])))
    key = "layers.0.mlp.down_proj.weight"  # [D, I]: new columns are zero
    state[key] = torch.cat((state[key], state[key].new_zeros(d, intermediate_size - old)), 1)
    wide.load_state_dict(state)
    wide._shared[:] = head._shared
    return wide.to(head.fc.weight.device, head.fc.weight.dtype).eval()


def new_eagle_for(target: Transformer, *, seed: int = 0, fc_bias: bool = True) -> EagleHead:
    """A randomly initialised head shaped for ``target`` (training starts here; tests use it)."""
    head = EagleHead(draft_config(target.cfg), fc_bias=fc_bias)
    random_init(head, seed)
    return head.to(target.device).attach(target).eval()

"""Online trainers: a shadow copy of the draft head that learns while the serving head serves.

Owns: the shadow module (what the worker differentiates), its optimizer, one guarded update
step, the weights to publish into the serving head, the adapter tensors to save, and an
exact count of the auxiliary memory it holds.

- :class:`LoraTrainer` (CL-LoRA): peft LoRA (r, alpha) on ``q_proj`` and ``v_proj`` of the
  shadow; the shadow shares every other parameter with the serving head (read-only) and
  owns a pristine copy of the two base projections. It publishes merged weights
  ``W + (alpha / r) * B @ A`` for q/v, so the serving head runs at full speed with no
  adapter code in the hot loop.
- :class:`FullTrainer` (OSD baseline): the shadow owns a copy of every head parameter
  (the embedding, when the head has its own, stays frozen like the target's LM head) and
  AdamW updates them all; it publishes all of them.

A step is discarded (the previous adapter stays, the counters say why) when the loss is not
finite, exceeds ``max_loss`` (a KL blow-up), or the gradient norm is not finite.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from evospec.adapt.config import AdaptConfig
from evospec.adapt.loss import Admission, admit, curriculum_loss, retained_kl
from evospec.adapt.unroll import TrajectoryBatch, draft_support_logits
from evospec.models.eagle import EagleHead


def qv_names(head) -> tuple[str, str]:
    """The parameter names of the draft attention's q and v projections (what CL-LoRA adapts)."""
    return (f"{head.attention_path}.q_proj.weight", f"{head.attention_path}.v_proj.weight")


QV = qv_names(EagleHead)  # an EAGLE-2 head's


@dataclass
class UpdateResult:
    ok: bool
    loss: float  # nan when no loss was computed
    seconds: float
    admitted: int  # admitted steps in the update's batch
    reason: str | None = None  # why it was discarded: "nonfinite-loss" | "blowup" | "nonfinite-grad"


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _set_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    setattr(owner, leaf, param)


def build_shadow(serving, pristine: dict[str, torch.Tensor], owned: tuple[str, ...]):
    """A head (EAGLE-2 or EAGLE-3) whose ``owned`` params are trainable copies of ``pristine``;
    the rest are the serving head's tensors, shared and frozen. Its embedding (and a tied
    LM head) are frozen views of the serving head's."""
    shadow = serving.clone()
    served = dict(serving.named_parameters())
    for name, _ in list(shadow.named_parameters()):
        if name in owned:
            _set_param(shadow, name, nn.Parameter(pristine[name].detach().clone()))
        else:
            _set_param(shadow, name, nn.Parameter(served[name].detach(), requires_grad=False))
    emb = serving.embedding().weight.detach()
    shadow._shared[:] = [nn.Embedding.from_pretrained(emb, freeze=True)]
    return shadow


class OnlineTrainer:
    """Common step / gate logic; subclasses build ``self.module`` and ``self.params``."""

    module: EagleHead
    params: list[nn.Parameter]

    def __init__(self, lm_head: torch.Tensor, cfg: AdaptConfig) -> None:
        self.lm_head = lm_head.detach()  # [V, D] the target's, frozen
        self.cfg = cfg
        # Held by a step (the adapter's worker thread) and by aux_bytes (any thread): reading a
        # parameter's .grad while backward replaces it on another thread is a data race in torch
        # (it crashed the process once in CI), so the admin state waits for the step to end.
        self._busy = threading.Lock()

    def _lm_weight(self) -> torch.Tensor:
        """[V, D] the rows draft logits are read from: an EAGLE-3 head's own LM head (trained
        along under OSD), else the frozen one given (the target's)."""
        own = self.module._modules.get("lm_head")
        return own.weight if own is not None else self.lm_head

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.params, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    @torch.no_grad()
    def gate(self, batch: TrajectoryBatch) -> tuple[Admission, torch.Tensor]:
        """Admission of every step under the current shadow weights -> (admission, kl [B, S])."""
        logits = draft_support_logits(self.module, self._lm_weight(), batch)
        kl = retained_kl(batch.support_logits, logits, self.cfg.temperature)
        return admit(batch, kl, self.cfg.gate_kl), kl

    def step(self, batch: TrajectoryBatch, admitted: torch.Tensor) -> UpdateResult:
        """``steps_per_update`` AdamW steps on the admitted steps; all-or-nothing."""
        with self._busy:
            return self._step(batch, admitted)

    def _step(self, batch: TrajectoryBatch, admitted: torch.Tensor) -> UpdateResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        n = int(admitted.sum())
        backup = None
        if cfg.steps_per_update > 1:
            backup = ([p.detach().clone() for p in self.params], _clone_state(self.opt.state_dict()))
        loss_value = math.nan
        for _ in range(cfg.steps_per_update):
            self.opt.zero_grad(set_to_none=True)
            logits = draft_support_logits(self.module, self._lm_weight(), batch)
            loss = curriculum_loss(batch, logits, admitted, temperature=cfg.temperature, beta=cfg.beta)
            loss_value = float(loss.detach())
            reason = None
            if not math.isfinite(loss_value):
                reason = "nonfinite-loss"
            elif loss_value > cfg.max_loss:
                reason = "blowup"
            else:
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(
                    self.params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
                )
                if not math.isfinite(float(norm)):
                    reason = "nonfinite-grad"
            if reason is not None:
                self.opt.zero_grad(set_to_none=True)
                if backup is not None:
                    self._restore(*backup)
                return UpdateResult(False, loss_value, time.perf_counter() - t0, n, reason)
            self.opt.step()
        return UpdateResult(True, loss_value, time.perf_counter() - t0, n)

    @torch.no_grad()
    def _restore(self, params: list[torch.Tensor], opt_state: dict) -> None:
        for p, saved in zip(self.params, params, strict=True):
            p.copy_(saved)
        self.opt.load_state_dict(opt_state)

    def aux_bytes(self) -> dict[str, int]:
        """Bytes held for adaptation: trainable weights, their grads, optimizer state, copies
        (after the step in progress, if any)."""
        with self._busy:
            return self._aux_bytes()

    def _aux_bytes(self) -> dict[str, int]:
        opt = [t for st in self.opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return {
            "trainable": tensor_bytes(self.params),
            "grads": tensor_bytes(p.grad for p in self.params),
            "optimizer": tensor_bytes(opt),
            "frozen_copies": tensor_bytes(self.frozen_copies()),
        }

    # -- subclass API --------------------------------------------------------------------------
    def frozen_copies(self) -> list[torch.Tensor]:
        return []

    def serving_weights(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


def _clone_state(state: dict) -> dict:
    if torch.is_tensor(state):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone_state(v) for v in state]
    return state


class LoraTrainer(OnlineTrainer):
    def __init__(
        self, serving: EagleHead, pristine: dict[str, torch.Tensor], lm_head: torch.Tensor, cfg: AdaptConfig
    ) -> None:
        from peft import LoraConfig, inject_adapter_in_model

        super().__init__(lm_head, cfg)
        self._qv = qv_names(serving)
        shadow = build_shadow(serving, pristine, owned=self._qv)
        for p in shadow.parameters():
            p.requires_grad_(False)
        lora = LoraConfig(
            r=cfg.rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            bias="none",
        )
        self.module = inject_adapter_in_model(lora, shadow)
        self._seed_lora_a(cfg.seed)
        self.params = [p for n, p in self.module.named_parameters() if "lora_" in n]
        for p in self.params:
            p.requires_grad_(True)
        self.opt = self._new_optimizer()

    @torch.no_grad()
    def _seed_lora_a(self, seed: int) -> None:
        """peft draws A (kaiming-uniform, B = 0) from the global RNG; draw it from ``seed`` instead,
        so an adapter's whole trajectory is reproducible and independent of other RNG users."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for layer in self._layers().values():
            a = layer.lora_A["default"].weight  # [r, in]
            fresh = torch.empty(a.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            a.copy_(fresh)

    def _layers(self):
        attn = self.module.get_submodule(self.module.attention_path)
        return {self._qv[0]: attn.q_proj, self._qv[1]: attn.v_proj}

    def frozen_copies(self) -> list[torch.Tensor]:
        return [layer.base_layer.weight for layer in self._layers().values()]

    @torch.no_grad()
    def serving_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in self._layers().items():
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
            out[name] = layer.base_layer.weight + layer.scaling["default"] * (b @ a)
        return out

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in self._layers().items():
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = layer.lora_A["default"].weight.detach().clone()
            out[f"{stem}.lora_B.weight"] = layer.lora_B["default"].weight.detach().clone()
        return out

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = self.adapter_tensors()
        if set(tensors) != set(mine):
            raise ValueError(f"adapter tensors {sorted(tensors)} do not match LoRA tensors {sorted(mine)}")
        for name, layer in self._layers().items():
            stem = name.removesuffix(".weight")
            for part, mod in (("lora_A", layer.lora_A["default"]), ("lora_B", layer.lora_B["default"])):
                t = tensors[f"{stem}.{part}.weight"]
                if t.shape != mod.weight.shape:
                    raise ValueError(f"{stem}.{part}: shape {tuple(t.shape)} != {tuple(mod.weight.shape)}")
                mod.weight.copy_(t)
        self.opt = self._new_optimizer()


class FullTrainer(OnlineTrainer):
    def __init__(
        self, serving: EagleHead, pristine: dict[str, torch.Tensor], lm_head: torch.Tensor, cfg: AdaptConfig
    ) -> None:
        super().__init__(lm_head, cfg)
        owned = tuple(n for n in pristine if not n.startswith("embed_tokens"))
        self.module = build_shadow(serving, pristine, owned=owned)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self._owned = owned
        self.opt = self._new_optimizer()

    @torch.no_grad()
    def serving_weights(self) -> dict[str, torch.Tensor]:
        named = dict(self.module.named_parameters())
        return {n: named[n].detach().clone() for n in self._owned}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        return self.serving_weights()

    @torch.no_grad()
    def load_adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if set(tensors) != set(self._owned):
            raise ValueError(f"OSD tensors {sorted(tensors)} do not match the head's {sorted(self._owned)}")
        named = dict(self.module.named_parameters())
        for n, t in tensors.items():
            if t.shape != named[n].shape:
                raise ValueError(f"{n}: shape {tuple(t.shape)} != {tuple(named[n].shape)}")
            named[n].copy_(t)
        self.opt = self._new_optimizer()


def make_trainer(
    serving: EagleHead, pristine: dict[str, torch.Tensor], lm_head: torch.Tensor, cfg: AdaptConfig
) -> OnlineTrainer:
    cls = LoraTrainer if cfg.mode == "clora" else FullTrainer
    return cls(serving, pristine, lm_head, cfg)

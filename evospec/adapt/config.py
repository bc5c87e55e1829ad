"""Settings of the online adaptation path (EvoSpec's CL-LoRA and the OSD baseline).

Owns: :class:`AdaptConfig`, the one typed record of every knob; defaults are the EvoSpec
paper's Table 7 (B = 32, lr 1e-5, T_KD = 1, K_logit = 256, epsilon_align = 0.1, r = alpha = 32,
beta = 0.3). Knows nothing about threads or models.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MODES = ("clora", "osd")


@dataclass(frozen=True)
class AdaptConfig:
    mode: str = "clora"  # "clora": LoRA on q_proj/v_proj | "osd": full-parameter updates
    buffer_size: int = 32  # admitted positions per update (B)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    temperature: float = 1.0  # distillation temperature T_KD (independent of sampling)
    k_logit: int = 256  # retained target logits per position (K_logit)
    gate_kl: float = 0.1  # admit a covered position when KL(target || draft) exceeds this ...
    # ... or when the draft's proposals at it were all rejected
    rank: int = 32  # LoRA rank r
    alpha: float = 32.0  # LoRA alpha (scaling alpha / r)
    beta: float = 0.3  # curriculum decay: w_j = exp(-beta * L_base * (j - 1))
    context: int = 1024  # committed (feature, token) pairs replayed before each round's root
    steps_per_update: int = 1  # optimizer steps per full buffer
    grad_clip: float = 1.0  # max grad norm (<= 0: off)
    max_loss: float = 50.0  # a loss above this is a blow-up: the update is discarded
    asynchronous: bool = True  # False: gate and update inline at the round end (tests)
    max_pending: int = 64  # rounds waiting for the worker; more are dropped and counted
    max_keys: int = 8  # adapter states kept per conversation/tenant key (LRU beyond)
    nice: int = 10  # CPU: scheduling niceness added to the worker thread (0: none)
    seed: int = 0  # initialises LoRA A of every new adapter state: same seed, same updates

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"adapt mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        positive = (
            "buffer_size",
            "k_logit",
            "rank",
            "context",
            "steps_per_update",
            "max_pending",
            "max_keys",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"adapt {name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "temperature", "alpha", "max_loss"):
            if not getattr(self, name) > 0:
                raise ValueError(f"adapt {name} must be > 0, got {getattr(self, name)}")
        if self.beta < 0 or self.gate_kl < 0 or self.weight_decay < 0:
            raise ValueError("adapt beta, gate_kl and weight_decay must be >= 0")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

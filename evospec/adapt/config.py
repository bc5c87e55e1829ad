"""Settings of the online adaptation path (EvoSpec's CL-LoRA and the OSD baseline).

Owns: :class:`AdaptConfig`, the one typed record of every knob (the ``adapt:`` section of a
serve config and the ``--adapt-*`` flags; see ``evospec/settings.py``); defaults are the
EvoSpec paper's Table 7 (B = 32, lr 1e-5, T_KD = 1, K_logit = 256, epsilon_align = 0.1,
r = alpha = 32, beta = 0.3). Knows nothing about threads or models.
"""

from __future__ import annotations

from dataclasses import dataclass

from evospec.settings import setting

MODES = ("clora", "osd")
SCOPES = ("global", "user")


@dataclass(frozen=True)
class AdaptConfig:
    # "clora": LoRA on q_proj/v_proj | "osd": full-parameter updates; follows the method
    mode: str = setting("clora", "adaptation mode", internal=True)
    buffer_size: int = setting(32, "admitted positions per update (B)", flag="--adapt-buffer")
    lr: float = setting(1e-5, "AdamW learning rate of the online updates")
    weight_decay: float = setting(0.0, "AdamW decoupled weight decay")
    temperature: float = setting(
        1.0, "distillation temperature T_KD of the KL objective (independent of sampling)"
    )
    k_logit: int = setting(256, "retained target logits per position (K_logit)")
    gate_kl: float = setting(
        0.1,
        "admit a covered position when KL(target || draft) exceeds this, or when the draft's proposals at it "
        "were all rejected",
        flag="--adapt-gate",
    )
    rank: int = setting(32, "LoRA rank r (clora, evospec-full)")
    alpha: float | None = setting(None, "LoRA alpha (scaling alpha / r); None: the rank")
    beta: float = setting(0.3, "curriculum decay: w_j = exp(-beta * L_base * (j - 1))")
    context: int = setting(1024, "committed (feature, token) pairs replayed before each round's root")
    steps_per_update: int = setting(1, "optimizer steps per full buffer", flag="--adapt-steps")
    grad_clip: float = setting(1.0, "max grad norm (<= 0: off)")
    max_loss: float = setting(50.0, "a loss above this is a blow-up: the update is discarded")
    # False: gate and update inline at the round end (tests, replays) -- see options.py: --adapt-sync
    asynchronous: bool = setting(True, "update on a worker thread", internal=True)
    max_pending: int = setting(64, "rounds waiting for the worker; more are dropped and counted")
    max_keys: int = setting(8, "adapter states kept per conversation/tenant key (LRU beyond)")
    nice: int = setting(10, "CPU: scheduling niceness added to the update thread (0: none)")
    seed: int = setting(0, "initialises LoRA A of every new adapter state: same seed, same updates")
    scope: str = setting(
        "global", "'global': one adapter; 'user': one per request's OpenAI user field (serve)"
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"adapt mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"adapt.scope {self.scope!r} is not one of {list(SCOPES)}")
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
                raise ValueError(f"adapt.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "temperature", "max_loss"):
            if not getattr(self, name) > 0:
                raise ValueError(f"adapt.{name} must be > 0, got {getattr(self, name)}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"adapt.alpha must be > 0, got {self.alpha}")
        for name in ("beta", "gate_kl", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"adapt.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def lora_alpha(self) -> float:
        """LoRA alpha: ``alpha``, or the rank when unset (scaling 1)."""
        return self.rank if self.alpha is None else self.alpha

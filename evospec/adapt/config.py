"""Settings of the online adaptation path (EvoSpec's CL-LoRA and the OSD baseline).

Owns: :class:`AdaptConfig`, the one typed record of every knob (the ``adapt:`` section of a
serve config and the ``--adapt-*`` flags; see ``evospec/settings.py``); defaults are the
EvoSpec paper's Table 7 (B = 32, lr 1e-5, T_KD = 1, K_logit = 256, epsilon_align = 0.1,
r = alpha = 32, beta = 0.3). Knows nothing about threads or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("clora", "osd")
SCOPES = ("global", "user")


def _opt(default, help_text: str, **extra):
    return field(default=default, metadata={"help": help_text, **extra})


@dataclass(frozen=True)
class AdaptConfig:
    # "clora": LoRA on q_proj/v_proj | "osd": full-parameter updates; follows the method
    mode: str = _opt("clora", "adaptation mode", internal=True)
    buffer_size: int = _opt(32, "admitted positions per update (B)", flag="--adapt-buffer")
    lr: float = _opt(1e-5, "AdamW learning rate of the online updates")
    weight_decay: float = _opt(0.0, "AdamW decoupled weight decay")
    temperature: float = _opt(
        1.0, "distillation temperature T_KD of the KL objective (independent of sampling)"
    )
    k_logit: int = _opt(256, "retained target logits per position (K_logit)")
    gate_kl: float = _opt(
        0.1,
        "admit a covered position when KL(target || draft) exceeds this, or when the draft's proposals at it "
        "were all rejected",
        flag="--adapt-gate",
    )
    rank: int = _opt(32, "LoRA rank r (clora, evospec-full)")
    alpha: float | None = _opt(None, "LoRA alpha (scaling alpha / r); None: the rank")
    beta: float = _opt(0.3, "curriculum decay: w_j = exp(-beta * L_base * (j - 1))")
    context: int = _opt(1024, "committed (feature, token) pairs replayed before each round's root")
    steps_per_update: int = _opt(1, "optimizer steps per full buffer", flag="--adapt-steps")
    grad_clip: float = _opt(1.0, "max grad norm (<= 0: off)")
    max_loss: float = _opt(50.0, "a loss above this is a blow-up: the update is discarded")
    # False: gate and update inline at the round end (tests, replays) -- see options.py: --adapt-sync
    asynchronous: bool = _opt(True, "update on a worker thread", internal=True)
    max_pending: int = _opt(64, "rounds waiting for the worker; more are dropped and counted")
    max_keys: int = _opt(8, "adapter states kept per conversation/tenant key (LRU beyond)")
    nice: int = _opt(10, "CPU: scheduling niceness added to the update thread (0: none)")
    seed: int = _opt(0, "initialises LoRA A of every new adapter state: same seed, same updates")
    scope: str = _opt("global", "'global': one adapter; 'user': one per request's OpenAI user field (serve)")

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

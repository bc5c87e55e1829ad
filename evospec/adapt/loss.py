"""EvoSpec's admission gate and curriculum-weighted KL objective (paper Eq. 4-5).

Owns the arithmetic only, on padded ``[B, S, K]`` tensors from ``unroll.py``:

- :func:`retained_kl`: KL(softmax(z_target / T) || softmax(z_draft / T)) per step, both on
  the same retained support (the target's top-K_logit ids of that step).
- :func:`admit`: routing and the gate. A step whose verified token was outside the active
  vocabulary belongs to the vocabulary path and is never admitted; a covered step is
  admitted when its KL exceeds ``gate_kl`` or the draft's proposals there were rejected.
- :func:`curriculum_weights`: w_j = exp(-beta * L_base * (j - 1)), L_base the first step's
  cross-entropy against the verified token (detached: a weight, not a target).
- :func:`curriculum_loss`: sum over admitted steps of w_j * T^2 * KL_j, divided by the number
  of admitted steps (so the learning rate does not depend on how full a batch is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evospec.adapt.unroll import TrajectoryBatch


def retained_kl(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[..., K] logits each -> [...] KL(target || draft) on the shared support."""
    log_p = torch.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def first_step_ce(draft_logits: torch.Tensor, target_index: torch.Tensor) -> torch.Tensor:
    """draft_logits [B, S, K], target_index [B, S] -> [B] cross-entropy of step 1 (T = 1)."""
    log_q = torch.log_softmax(draft_logits[:, 0].float(), dim=-1)  # [B, K]
    return -log_q.gather(1, target_index[:, :1]).squeeze(1)


def curriculum_weights(l_base: torch.Tensor, steps: int, beta: float) -> torch.Tensor:
    """l_base [B] -> w [B, S] with w[:, j-1] = exp(-beta * l_base * (j - 1))."""
    j = torch.arange(steps, device=l_base.device, dtype=torch.float32)  # j - 1
    return torch.exp(-beta * l_base.detach().float()[:, None] * j[None, :])


@dataclass
class Admission:
    mask: torch.Tensor  # [B, S] bool: steps that enter the replay buffer
    covered: int  # valid steps whose verified token was active
    routed_oov: int  # valid steps left to the vocabulary path
    by_kl: int  # admitted because KL > gate (rejected or not)
    by_reject: int  # admitted because the draft's proposals were rejected


def admit(batch: TrajectoryBatch, kl: torch.Tensor, gate_kl: float) -> Admission:
    """kl [B, S] (any grad state) -> which steps are admitted, with counts."""
    valid = batch.step_valid
    covered = valid & batch.in_vocab
    high = kl.detach() > gate_kl
    mask = covered & (high | batch.rejected)
    return Admission(
        mask=mask,
        covered=int(covered.sum()),
        routed_oov=int((valid & ~batch.in_vocab).sum()),
        by_kl=int((covered & high).sum()),
        by_reject=int((covered & batch.rejected).sum()),
    )


def curriculum_loss(
    batch: TrajectoryBatch,
    draft_logits: torch.Tensor,  # [B, S, K]
    admitted: torch.Tensor,  # [B, S] bool
    *,
    temperature: float,
    beta: float,
) -> torch.Tensor:
    """Scalar: mean over admitted steps of w_j * T^2 * KL_j."""
    kl = retained_kl(batch.support_logits, draft_logits, temperature)  # [B, S]
    w = curriculum_weights(first_step_ce(draft_logits, batch.target_index), kl.shape[1], beta)
    per_step = w * (temperature**2) * kl
    n = admitted.sum().clamp(min=1)
    return (per_step * admitted).sum() / n

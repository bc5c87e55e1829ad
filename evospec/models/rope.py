"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and cos/sin.

Owns: the frequency table of one RoPE variant. Knows nothing about attention or caches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies for the given base and scaling rule."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float()
    kind = scaling["rope_type"]
    if kind == "freq_factors":
        return (inv / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
        # between interpolated smoothly (Meta's published rule).
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryTable(nn.Module):
    """cos/sin for arbitrary absolute positions (rotate-half layout, [n, head_dim])."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> cos/sin [n, Dh]; per-row positions [B, n] -> [B, 1, n, Dh]."""
        freqs = positions.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:
            emb = emb[:, None]  # broadcast over heads
        return emb.cos().to(dtype), emb.sin().to(dtype)

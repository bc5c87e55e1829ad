"""SpecVocab's selector: approximate logits from a down-projected draft feature.

Owns: :class:`LowRankSelector` (``down`` [D, r] projects the draft feature, ``codes`` [V, r]
hold one rank-r code per vocabulary id; approximate logits = (h @ down) @ codes.T, [n, V]),
:func:`svd_selector` (the best rank-r factorisation of the LM head in Frobenius norm: the
training start), its file (``specvocab.safetensors`` in the index directory) and
:func:`load_selector`, which refuses a selector made for another model.

SpecVocab (Williams et al. 2026, arXiv 2602.13836) ranks in two stages each draft step: the
approximate logits pick the top-k candidates (k = 2048 by default, the size EvoSpec's paper
compares against), then the exact logits of those candidates only are computed
(``vocab/head.py: TwoStageHead``). The selector is trained by distillation
(``evospec train-vocab specvocab``). Cost per draft row: V*r + k*D multiply-adds instead of V*D.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_RANK = 64
DEFAULT_CANDIDATES = 2048


class LowRankSelector(nn.Module):
    """[n, D] draft features -> [n, V] approximate logits."""

    def __init__(self, down: torch.Tensor, codes: torch.Tensor) -> None:
        super().__init__()
        self.down = nn.Parameter(down)  # [D, r]
        self.codes = nn.Parameter(codes)  # [V, r]

    @property
    def rank(self) -> int:
        return self.down.shape[1]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.down) @ self.codes.T

    def num_parameters(self) -> int:
        return self.down.numel() + self.codes.numel()


def svd_selector(lm_head: torch.Tensor, rank: int = DEFAULT_RANK) -> LowRankSelector:
    """W ([V, D]) ~= codes @ down.T from its top-``rank`` singular triplets (split as sqrt(S))."""
    vocab, dim = lm_head.shape
    if not 1 <= rank <= min(vocab, dim):
        raise ValueError(f"specvocab rank must be in [1, {min(vocab, dim)}], got {rank}")
    u, s, vh = torch.linalg.svd(lm_head.detach().float().cpu(), full_matrices=False)
    root = s[:rank].sqrt()
    return LowRankSelector((vh[:rank].T * root).contiguous(), (u[:, :rank] * root).contiguous())


def save_selector(selector: LowRankSelector, path, *, fingerprint: str) -> None:
    from evospec.common import save_tensors

    tensors = {
        "down": selector.down.detach().to(torch.float16).contiguous().cpu(),
        "codes": selector.codes.detach().to(torch.float16).contiguous().cpu(),
    }
    meta = {"kind": "specvocab-selector", "rank": str(selector.rank), "model_fingerprint": fingerprint}
    save_tensors(tensors, str(path), metadata=meta)


def load_selector(trained, *, vocab_size: int, dim: int, fingerprint: str, dtype=torch.float32, device="cpu"):
    """The :class:`LowRankSelector` of an index bundle's ``specvocab`` file (``TrainedFile``)."""
    trained.check("specvocab-selector", fingerprint, "evospec train-vocab specvocab --model MODEL")
    down, codes = trained.tensors["down"], trained.tensors["codes"]
    if down.shape[0] != dim or codes.shape[0] != vocab_size or down.shape[1] != codes.shape[1]:
        raise ValueError(
            f"the SpecVocab selector has down {tuple(down.shape)} and codes {tuple(codes.shape)}; "
            f"the model needs [{dim}, r] and [{vocab_size}, r]"
        )
    sel = LowRankSelector(down.to(dtype), codes.to(dtype))
    return sel.to(device=device).eval().requires_grad_(False)

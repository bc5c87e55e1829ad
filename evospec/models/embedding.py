"""Token embeddings kept the way a GGUF stores them: int8 codes, one float16 scale per 32 columns.

Owns: :func:`compact_rows` (the exact int8 form of a float32 table, or None where it has none),
:class:`CompactEmbedding` (the module that takes ``nn.Embedding``'s place with it) and
:func:`compact_embedding` (the swap, at load). Knows tensors and modules only.

Why: both registered models ship ``token_embd`` as Q8_0 (32 int8 codes and one float16 scale a
block), and loading converts it to float32: 4.2x its bytes, resident for the life of the
process -- SmolLM2-135M 108 MB, Gemma-3-270M 671 MB -- while decoding reads one row a token.
Those floats are exactly scale x code (an 11-bit float16 significand times a 7-bit code needs
18 bits, float32 has 24), so the codes and scales give every row back bit for bit: the model's
outputs do not change. A quantised LM head (``quant.py``) reads its own int8 copy, so nothing
on the decoding path needs the float table any more.

:attr:`CompactEmbedding.weight` still answers with the float32 table for the few callers that
want it whole (training, an adapting draft's KL targets, EAGLE-3's copy of a tied head, an
index's fingerprint): built when asked for and kept only while a caller holds it, so such a
caller costs at most the memory it always did, never a wrong value.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

log = logging.getLogger(__name__)

GROUP = 32  # columns per scale (Q8_0's block)
_CHUNK = 8192  # rows checked at a time: the check's temporaries stay a few MB


def compact_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes int8 [V, D], scales float16 [V, D / 32]) whose products are ``weight``'s values
    bit for bit (float32 [V, D] on the CPU, D a multiple of 32), or None where it has no such
    form (not float32, not a Q8_0 table's values, a -0.0 the products would not give back)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    vocab, dim = weight.shape
    if dim % GROUP or vocab == 0:
        return None
    codes = torch.empty(vocab, dim, dtype=torch.int8)
    scales = torch.empty(vocab, dim // GROUP, dtype=torch.float16)
    for start in range(0, vocab, _CHUNK):
        block = weight[start : start + _CHUNK].detach().reshape(-1, dim // GROUP, GROUP)  # [c, G, 32]
        step = block.abs().amax(-1) / 127  # [c, G]: a Q8_0 block's largest code is +-127
        half = step.to(torch.float16)
        if not torch.equal(half.float(), step):
            return None
        q = (block / step.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().to(torch.int8)
        if not torch.equal((q.float() * step[..., None]).view(torch.int32), block.view(torch.int32)):
            return None  # (compared as bits: a -0.0 must come back as -0.0; all-zero blocks give 0)
        codes[start : start + _CHUNK] = q.view(-1, dim)
        scales[start : start + _CHUNK] = half
    return codes, scales


def embed_rows_ref(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The rows ``ids`` ([...] int64) of a compact table as float32 [..., D], in torch ops: what
    the op ``embed_rows`` computes (each value code * its group's scale, one exact product)."""
    dim = codes.shape[1]
    q = codes[ids].float().unflatten(-1, (dim // GROUP, GROUP))  # [..., G, 32]
    return (q * scales[ids].float()[..., None]).flatten(-2)


class CompactEmbedding(nn.Module):
    """``nn.Embedding``'s place for a table :func:`compact_rows` could take: the same rows, a
    quarter of the bytes. ``weight``: the float32 table, built on first use (see the module)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.register_buffer("codes", codes, persistent=False)  # [V, D] int8
        self.register_buffer("scales", scales, persistent=False)  # [V, D / 32] float16
        self.materialised = 0  # times the float table was built (tests: the decoding path never does)
        self._dense: weakref.ref[torch.Tensor] | None = None  # the last one built, while a caller holds it

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., D] float32
        if _has_op():
            return torch.ops.evospec.embed_rows(self.codes, self.scales, ids)
        return embed_rows_ref(self.codes, self.scales, ids)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 table [V, D], built where no caller still holds the last one built: a
        caller that keeps it (an adapting draft's KL targets) pays its memory, one that reads it
        once (an index's fingerprint) lets it go again."""
        dense = self._dense() if self._dense is not None else None
        if dense is None:
            log.info(
                "building the float32 embedding table (%.0f MB) for a caller that reads it whole",
                self.codes.numel() * 4 / 2**20,
            )
            ids = torch.arange(self.num_embeddings, device=self.codes.device)
            dense = embed_rows_ref(self.codes, self.scales, ids)
            self._dense = weakref.ref(dense)
            self.materialised += 1
        return dense

    def __dir__(self):
        # torch.jit.trace scans a module by reading every attribute dir() names
        # (_jit_internal.module_has_exports): that would build the table for every recorded graph
        return [name for name in super().__dir__() if name != "weight"]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 codes + float16 scales per {GROUP}"


def _has_op() -> bool:
    return hasattr(torch.ops.evospec, "embed_rows")


def compact_embedding(model: nn.Module) -> int:
    """Swap ``model.embed_tokens`` (a float32 ``nn.Embedding`` on the CPU) for a
    :class:`CompactEmbedding` where its table has the exact form and no dense layer reads it
    (a tied LM head must be quantised: ``quant.QuantLinear``, which is re-tied to the new
    module); returns the bytes freed (0: left as it was). Before drafts attach to the model
    (they share its embedding module)."""
    from evospec.models.quant import QuantLinear

    emb = getattr(model, "embed_tokens", None)
    if not isinstance(emb, nn.Embedding):
        return 0
    head = getattr(model, "lm_head", None)
    tied_dense = isinstance(head, nn.Linear) and head.weight is emb.weight
    if tied_dense or (head is not None and not isinstance(head, nn.Linear | QuantLinear)):
        return 0
    pair = compact_rows(emb.weight)
    if pair is None:
        return 0
    compact = CompactEmbedding(*pair)
    if isinstance(head, QuantLinear) and head.weight is emb.weight:
        head.tie(compact)
    freed = emb.weight.nbytes - compact.nbytes
    model.embed_tokens = compact
    return freed

"""Outputs of the int8-activation kernels and of a fused int4 model, for comparing builds.

``python -m tests.kernels.isa_outputs OUT`` (run by ``test_isa_builds.py`` with
``EVOSPEC_CPU_CFLAGS`` naming another instruction set) saves :func:`outputs` of the op library
that environment builds; the test compares them with the default build's, bit for bit. With
``--fallback`` it saves :func:`fallback_outputs`, for a build below AVX2.
"""

from __future__ import annotations

import sys

import torch

from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.kernels.int4_matmul import pack_int4
from evospec.kernels.int8_matmul import pack_int8
from evospec.models.fused import enable_fused_ops
from evospec.models.quant import quantize_linears
from tests.decoding.spec_helpers import prompt_of, tiny_target


def outputs() -> dict[str, torch.Tensor | str]:
    """int4 and int8 products of 1-5 rows (float32 and bf16 inputs), decode attention (f16 and
    f32 caches, head size 64), and a tiny int4 model's prefill logits and greedy tokens on the
    fused ops (the layer team, attention, norms)."""
    assert load_cpu_ops()
    torch.manual_seed(0)
    out: dict[str, torch.Tensor | str] = {"isa": torch.ops.evospec.int4_isa()}
    n, k = 16 * 12, 192
    w4 = pack_int4(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32), -torch.rand(n, k // 32))
    w8, s8 = pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8)), torch.rand(n)
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k) * 3
        out[f"int4_f32_{m}"] = torch.ops.evospec.int4_matmul(x, w4)
        out[f"int4_bf16_{m}"] = torch.ops.evospec.int4_matmul(x.bfloat16(), w4)
        out[f"int8_f32_{m}"] = torch.ops.evospec.int8_matmul(x, w8, s8)
    for n, s, dtype in ((1, 45, torch.float16), (3, 70, torch.float16), (2, 33, torch.float32)):
        q = torch.randn(1, 6, n, 64)
        keys, values = torch.randn(1, 2, s, 64).to(dtype), torch.randn(1, 2, s, 64).to(dtype)
        out[f"attention_{n}_{s}"] = torch.ops.evospec.decode_attention(q, keys, values, None, 0.125, 0)
    model = tiny_target(5, head_dim=16)
    quantize_linears(model, "int4")
    model.exact_rows = True
    assert enable_fused_ops(model)
    tokens = torch.tensor([prompt_of(3, 12)])
    cache = model.new_cache(32)
    with torch.inference_mode():
        logits = model(tokens, torch.arange(12), cache).logits[0]
        out["prefill_logits"] = logits
        steps = [int(logits[-1].argmax())]
        for pos in range(12, 20):
            step = model(torch.tensor([[steps[-1]]]), torch.tensor([pos]), cache).logits[0, -1]
            steps.append(int(step.argmax()))
            out[f"step_logits_{pos}"] = step
    out["greedy"] = torch.tensor(steps)
    return out


def fallback_outputs() -> dict[str, torch.Tensor | str | bool]:
    """For a build without AVX2 (no int8-activation kernels): whether the op library loads, its
    ISA, and a tiny int4 model's prefill logits with the fused ops and with plain torch ops."""
    out: dict[str, torch.Tensor | str | bool] = {"loaded": load_cpu_ops()}
    out["isa"] = torch.ops.evospec.int4_isa() if out["loaded"] else "unloaded"
    model = tiny_target(5, head_dim=16)
    quantize_linears(model, "int4")
    tokens = torch.tensor([prompt_of(3, 12)])
    with torch.inference_mode():
        out["plain_logits"] = model(tokens, torch.arange(12), model.new_cache(32)).logits[0]
        out["fused"] = enable_fused_ops(model)
        out["fused_logits"] = model(tokens, torch.arange(12), model.new_cache(32)).logits[0]
    return out


if __name__ == "__main__":
    torch.save(fallback_outputs() if sys.argv[2:] == ["--fallback"] else outputs(), sys.argv[1])

"""Fused elementwise ops of a decoder layer on the CPU (``cpu_ops.cpp``), built on first use.

Owns: building the C++ source into a torch op library once per machine (cached under
``$EVOSPEC_HOME/kernels/<key>``: the source, torch's version and this CPU's flags), loading it,
and a torch reference of each op with the same contract (for tests, and the numbers the
compiled ops must stay close to). Knows tensors only: no models.

The ops (shapes in ``cpu_ops.cpp``): ``rms_norm_bf16``, ``add_rms_norm_bf16``, ``rope_qkv``,
``silu_mul_bf16``, Gemma-3's ``rope_qkv_normed``, ``norm_add_rms_norm_bf16`` and
``gelu_mul_bf16``, and ``decode_attention`` (``attention.cpp``: steps, chains and prefill rows over
an f32 or f16 KV cache); the same library carries the int4 x int8 matmuls of
``int4_matmul.cpp`` and ``int8_matmul.cpp`` (``int4_matmul.py``, ``int8_matmul.py``). They
replace ~45 small aten calls per layer of a quantised decode step (norm pieces, casts, RoPE
slices) with four, and SDPA's one-row attention with a leaner loop. Each computes a row with
the same code whatever the number of rows, so a chain verified in one call reproduces
one-token steps bitwise.

:func:`load_cpu_ops` returns None where no op library can be had (no C++ compiler, a failed
build, ``EVOSPEC_CPU_OPS=0``): callers then keep their plain torch path. A model decides once,
at load, and uses the same path for every forward, so its methods agree with each other.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from evospec.common import evospec_home

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(f)
    for f in (
        "cpu_ops.cpp",
        "attention.cpp",
        "attention_op.cpp",
        "int4_matmul.cpp",
        "int8_matmul.cpp",
        "llama_layer.cpp",
    )
)
# included by the sources: part of the build key
HEADER_NAMES = (
    "attention.h",
    "bf16.h",
    "fastexp.h",
    "int4_tiles.h",
    "llama_layer.h",
    "rows.h",
    "team.h",
    "vnni.h",
)
HEADERS = tuple(Path(__file__).with_name(f) for f in HEADER_NAMES)
DISABLE_ENV = "EVOSPEC_CPU_OPS"  # "0": never build or load the op library
# -fno-trapping-math: lets loops with comparisons and float->int conversions (exp_f32) vectorise;
# it changes no result (no reassociation, no contraction)
# -fopenmp: at::parallel_for is a header template that runs its body on one thread unless the
# caller is compiled with OpenMP (torch's own ops are); linking it names libgomp.so.1, which
# resolves to the copy torch already loaded
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")
# extra compiler flags, appended (part of the build key): "-mno-avx512f" builds the AVX2 kernels
# an AVX-512 machine would not pick, for tests and benchmarks of what laptops without it run
EXTRA_CFLAGS_ENV = "EVOSPEC_CPU_CFLAGS"
LDFLAGS = ("-fopenmp",)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cflags() -> tuple[str, ...]:
    return CFLAGS + tuple(os.environ.get(EXTRA_CFLAGS_ENV, "").split())


def build_key() -> str:
    """What the built library depends on: the source, torch's version, the flags, the CPU."""
    h = hashlib.sha256(b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS)))
    for part in (torch.__version__, " ".join(_cflags() + LDFLAGS), platform.machine(), _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


@functools.cache
def load_cpu_ops() -> bool:
    """Build (first time on this machine: ~10 s here) and load the op library; True when
    ``torch.ops.evospec`` has the ops, False where it cannot (logged once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False
    if _registered():
        return True
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler found: the fused CPU ops are off (decoding uses plain torch ops)")
        return False
    folder = evospec_home() / "kernels" / build_key()
    try:
        from torch.utils import cpp_extension

        folder.mkdir(parents=True, exist_ok=True)
        lib = folder / "evospec_cpu_ops.so"
        if not lib.exists():
            log.warning("building the fused CPU ops once for this machine (10-60 s) in %s", folder)
            cpp_extension.load(
                name="evospec_cpu_ops",
                sources=[str(src) for src in SOURCES],
                extra_cflags=list(_cflags()),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(folder),
                is_python_module=False,
                verbose=False,
            )
        else:
            torch.ops.load_library(str(lib))
    except Exception:  # a failed build or load: stay on plain torch ops
        log.warning("could not build the fused CPU ops; decoding uses plain torch ops", exc_info=True)
        return False
    return _registered()


def _registered() -> bool:
    return hasattr(torch.ops, "evospec") and hasattr(torch.ops.evospec, "rope_qkv")


# --- torch references: the same contracts, in plain torch ops --------------------------------


def rms_norm_bf16_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x f32 [..., D], w f32 [D] -> bf16 [..., D]."""
    return F.rms_norm(x, w.shape, w, eps).to(torch.bfloat16)


def add_rms_norm_bf16_ref(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y in f32, its rms norm in bf16)."""
    s = x + y.float()
    return s, rms_norm_bf16_ref(s, w, eps)


def rope_qkv_ref(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv bf16 [B, n, (hq + 2 hk) Dh], cos/sin f32 [n, Dh] or [B, n, Dh] -> rotated q
    [B, hq, n, Dh], rotated k and plain v [B, hk, n, Dh], all f32."""
    b, n, _ = qkv.shape
    dh = cos.shape[-1]
    heads = qkv.float().view(b, n, hq + 2 * hk, dh).transpose(1, 2)  # [B, heads, n, Dh]
    c = cos.reshape(-1, n, dh)[:, None]  # [1 or B, 1, n, Dh]
    s = sin.reshape(-1, n, dh)[:, None]
    qk = heads[:, : hq + hk]
    half = dh // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * c + rotated * s
    return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), heads[:, hq + hk :].contiguous()


def rope_qkv_normed_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    hq: int,
    hk: int,
    qw: torch.Tensor,
    kw: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope_qkv_ref with each q head RMS-normed by ``qw`` and each k head by ``kw`` ([Dh]) first."""
    b, n, _ = qkv.shape
    dh = cos.shape[-1]
    heads = qkv.float().view(b, n, hq + 2 * hk, dh)
    q = F.rms_norm(heads[:, :, :hq], (dh,), qw, eps)
    k = F.rms_norm(heads[:, :, hq : hq + hk], (dh,), kw, eps)
    c = cos.reshape(-1, n, dh)[:, None]
    s = sin.reshape(-1, n, dh)[:, None]
    qk = torch.cat([q, k], dim=2).transpose(1, 2)  # [B, hq + hk, n, Dh]
    half = dh // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * c + rotated * s
    v = heads[:, :, hq + hk :].transpose(1, 2)
    return qk[:, :hq].contiguous(), qk[:, hq:].contiguous(), v.contiguous()


def norm_add_rms_norm_bf16_ref(
    x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, w_next: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + rms_norm(y) by w in f32, its rms norm by w_next in bf16): a Gemma sublayer's exit."""
    s = x + F.rms_norm(y.float(), w.shape, w, eps)
    return s, rms_norm_bf16_ref(s, w_next, eps)


def gelu_mul_bf16_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu bf16 [..., 2 I] -> gelu_tanh(gate) * up, bf16 [..., I]."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(torch.bfloat16)


def silu_mul_bf16_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu bf16 [..., 2 I] -> silu(gate) * up, bf16 [..., I]."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(torch.bfloat16)


def decode_attention_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [B, H, n, Dh], keys/values [B, H_kv, S, Dh] (grouped queries); row j sees the first
    S - n + 1 + j keys, and for n = 1 ``mask`` (bool, S or B * S elements, True = attend);
    ``window`` > 0 hides keys ``window`` or more behind a row's last one
    -> softmax(scale q k^T) v [B, H, n, Dh], f32."""
    n, s = q.shape[2], keys.shape[2]
    if mask is not None:
        mask = mask.reshape(-1, 1, 1, s)  # [1 or B, 1, 1, S]
    elif n > 1 or window:
        mask = torch.ones(n, s, dtype=torch.bool).tril(s - n)
    if window:
        last = torch.arange(s - n, s)[:, None]  # row j's last visible key
        mask = mask & (last - torch.arange(s)[None, :] < window)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
    )

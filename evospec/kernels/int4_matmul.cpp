// 4-bit weight x 8-bit activation matmul for the CPU (AVX-512 VNNI, AVX-VNNI or AVX2: vnni.h),
// registered as torch ops.
//
// Contract (see int4_matmul.py for the packing and the torch reference):
//   int4_vnni() -> bool: whether this build has the kernel (compiled for AVX2 + FMA + F16C or later)
//   int4_isa() -> str: which instruction set it uses ("avx512-vnni", "avx-vnni", "avx2"; "none")
//   int4_block_rows() -> int: the activation rows one pass over a weight tile takes (8 on AVX-512,
//                             4 elsewhere: int4_tiles.h, kRows)
//   int4_matmul(x f32 or bf16 [M, K], packed u8 [N/16, K/32, 320], stream = false) -> x's dtype [M, N];
//     stream: the weight is read once a forward (vnni.h, prefetch_weight)
// Weights: w[n, k] = q * scale[n, g] + zero[n, g] for q in 0..15 (g = k / 32). Tile t holds
// outputs 16t..16t+15; its group g is 320 contiguous bytes (one stream to read): 4 blocks of 64,
// block b byte 4 l + j holding q[16t + l, 32g + 8b + j] in its low nibble and
// q[16t + l, 32g + 8b + 4 + j] in its high one, then the 16 scales and the 16 zeros (float16).
// Activations: each row's group of 32 is quantised to int8 by its own scale a = max|x| / 127
// (codes rounded to nearest even), as llama.cpp's Q8_0. Per row and group, in float32:
//   y += a * (scale * float(sum_k q_k c_k) + zero * float(sum_k c_k))
// over the groups in order (-ffp-contract=off: no fused multiply-adds), then one rounding to
// bf16 for bf16 inputs. A row's bits depend only on that row: one-token steps and verified
// chains agree bitwise, whatever M and the thread split.
//
// Why: a verify forward's extra rows are compute, not weight reads. torch's int4 kernel takes
// bf16 activations and runs float FMAs (~1.1 ms per extra SmolLM2 row on two Zen 4 cores);
// VNNI's vpdpbusd does 64 int8 multiply-adds per instruction.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "int4_tiles.h"
#include "vnni.h"

#include <cstdint>
#include <cstring>
#include <string>

namespace {

using namespace evospec_int4;

bool int4_vnni() {
#ifdef EVOSPEC_VNNI
  return true;
#else
  return false;
#endif
}

int64_t int4_block_rows() { return kRows; }  // activation rows one pass over a weight tile takes

std::string int4_isa() {  // which instruction set the int8-activation kernels use (vnni.h)
#ifdef EVOSPEC_VNNI
  return evospec_vnni::kIsa;
#else
  return "none";
#endif
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, bool stream) {
#ifndef EVOSPEC_VNNI
  TORCH_CHECK(false, "int4_matmul: this build has no int8-activation kernel (AVX2 or later; check int4_vnni() first)");
  return x;
#else
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_matmul: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(), "int4_matmul: packed must be contiguous uint8 [N/16, K/32, 320]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), groups = packed.size(1), n = tiles * kTile;
  TORCH_CHECK(k == groups * kGroup, "int4_matmul: x has ", k, " columns, the weight ", groups * kGroup);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto act = evospec_vnni::quantize_rows(xc);
  const int8_t* const codes = act.codes;
  const float* const ascale = act.scale;
  const float* const asum = act.sum;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  // Threads split the output tiles; each thread runs every row block over its tiles.
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    if (bf16)
      tile_range(wp, groups, first, last, codes, ascale, asum, m, k, static_cast<uint16_t*>(op), n, stream);
    else
      tile_range(wp, groups, first, last, codes, ascale, asum, m, k, static_cast<float*>(op), n, stream);
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evospec, m) {
  m.def("int4_vnni() -> bool", &int4_vnni);
  m.def("int4_isa() -> str", &int4_isa);
  m.def("int4_block_rows() -> int", &int4_block_rows);
  m.def("int4_matmul(Tensor x, Tensor packed, bool stream=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) { m.impl("int4_matmul", &int4_matmul); }

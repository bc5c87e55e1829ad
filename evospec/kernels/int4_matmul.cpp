// 4-bit weight x 8-bit activation matmul for the CPU (AVX-512 VNNI), registered as torch ops.
//
// Contract (see int4_matmul.py for the packing and the torch reference):
//   int4_vnni() -> bool: whether this build has the kernel (compiled with AVX-512 BW + VNNI)
//   int4_matmul(x f32 or bf16 [M, K], packed u8 [N/16, K/32, 320]) -> x's dtype [M, N]
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

#include "vnni.h"

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRows = 4;    // activation rows sharing one unpacking of a weight group
constexpr int64_t kAhead = 8;   // weight groups prefetched ahead (2.5 KB: past the end is harmless)
constexpr int64_t kBlock = 320;  // bytes per tile group: 256 of codes, 16 float16 scales, 16 zeros

bool int4_vnni() {
#ifdef EVOSPEC_VNNI
  return true;
#else
  return false;
#endif
}

#ifdef EVOSPEC_VNNI

using evospec_vnni::kGroup;
using evospec_vnni::kTile;

// Rows 0..NR-1 of one tile: out[r * n + 0..15]. Each row sums its group's 8 dot products in
// independent int32 chains (exact: integer sums do not depend on their order), so the
// multiply-adds of all rows overlap instead of waiting on each other's latency.
template <int NR, typename Out>
void tile_rows(const uint8_t* packed, int64_t groups, const int8_t* codes, const float* ascale, const float* asum,
               int64_t k, Out* out, int64_t n) {
  constexpr int kChains = NR == 1 ? 4 : 2;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wp = packed + g * kBlock;
    for (int b = 0; b < 5; ++b) _mm_prefetch(reinterpret_cast<const char*>(wp + kAhead * kBlock + 64 * b), _MM_HINT_T0);
    __m512i w[8];
    for (int b = 0; b < 4; ++b) {
      const __m512i v = _mm512_loadu_si512(wp + 64 * b);
      w[2 * b] = _mm512_and_si512(v, low);
      w[2 * b + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 256)));
    const __m512 wz = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 288)));
    __m512i d[NR][kChains];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kChains; ++c) d[r][c] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j)
      for (int r = 0; r < NR; ++r) {
        int32_t cj;
        std::memcpy(&cj, codes + r * k + g * kGroup + 4 * j, sizeof cj);
        d[r][j % kChains] = _mm512_dpbusd_epi32(d[r][j % kChains], w[j], _mm512_set1_epi32(cj));
      }
    for (int r = 0; r < NR; ++r) {
      __m512i dr = d[r][0];
      for (int c = 1; c < kChains; ++c) dr = _mm512_add_epi32(dr, d[r][c]);
      const __m512 t = _mm512_add_ps(_mm512_mul_ps(ws, _mm512_cvtepi32_ps(dr)),
                                     _mm512_mul_ps(wz, _mm512_set1_ps(asum[r * groups + g])));
      acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(_mm512_set1_ps(ascale[r * groups + g]), t));
    }
  }
  for (int r = 0; r < NR; ++r) evospec_vnni::store_tile(out + r * n, acc[r]);
}

template <typename Out>
void tile_block(int64_t nr, const uint8_t* packed, int64_t groups, const int8_t* codes, const float* ascale,
                const float* asum, int64_t k, Out* out, int64_t n) {
  switch (nr) {
    case 1: return tile_rows<1>(packed, groups, codes, ascale, asum, k, out, n);
    case 2: return tile_rows<2>(packed, groups, codes, ascale, asum, k, out, n);
    case 3: return tile_rows<3>(packed, groups, codes, ascale, asum, k, out, n);
    default: return tile_rows<4>(packed, groups, codes, ascale, asum, k, out, n);
  }
}

#endif

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed) {
#ifndef EVOSPEC_VNNI
  TORCH_CHECK(false, "int4_matmul: this build has no AVX-512 VNNI kernel (check int4_vnni() first)");
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
    for (int64_t t = first; t < last; ++t) {
      const uint8_t* wt = wp + t * groups * kBlock;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t nr = std::min(kRows, m - r0);
        const int8_t* c = codes + r0 * k;
        const float *as = ascale + r0 * groups, *su = asum + r0 * groups;
        if (bf16)
          tile_block(nr, wt, groups, c, as, su, k, static_cast<uint16_t*>(op) + r0 * n + t * kTile, n);
        else
          tile_block(nr, wt, groups, c, as, su, k, static_cast<float*>(op) + r0 * n + t * kTile, n);
      }
    }
  });
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evospec, m) {
  m.def("int4_vnni() -> bool", &int4_vnni);
  m.def("int4_matmul(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) { m.impl("int4_matmul", &int4_matmul); }

// The int4 x int8 VNNI tile loop (int4_matmul.cpp's arithmetic), shared by its torch op and by
// llama_layer.cpp's layer, whose threads each run a range of output tiles.
#pragma once

#include "vnni.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace evospec_int4 {

constexpr int64_t kRows = 4;    // activation rows sharing one unpacking of a weight group
constexpr int64_t kAhead = 8;   // weight groups prefetched ahead (2.5 KB: past the end is harmless)
constexpr int64_t kBlock = 320;  // bytes per tile group: 256 of codes, 16 float16 scales, 16 zeros

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

#ifdef EVOSPEC_VNNI

// Output tiles [first, last) of x @ w^T for every row: the activations' codes (codes [m, k], scale
// and sum [m, k/32]) against packed [tiles, groups, 320], into out [m, n] (float32 or bf16).
template <typename Out>
void tile_range(const uint8_t* packed, int64_t groups, int64_t first, int64_t last, const int8_t* codes,
                const float* ascale, const float* asum, int64_t m, int64_t k, Out* out, int64_t n) {
  for (int64_t t = first; t < last; ++t) {
    const uint8_t* wt = packed + t * groups * kBlock;
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int64_t nr = std::min(kRows, m - r0);
      tile_block(nr, wt, groups, codes + r0 * k, ascale + r0 * groups, asum + r0 * groups, k,
                 out + r0 * n + t * evospec_vnni::kTile, n);
    }
  }
}

#endif

}  // namespace evospec_int4

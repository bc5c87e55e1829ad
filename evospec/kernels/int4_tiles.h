// The int4 x int8 VNNI tile loop (int4_matmul.cpp's arithmetic), shared by its torch op and by
// llama_layer.cpp's layer, whose threads each run a range of output tiles.
#pragma once

#include "vnni.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace evospec_int4 {

#if defined(EVOSPEC_ZMM)
constexpr int64_t kRows = 8;    // activation rows sharing one unpacking of a weight group (32 zmm)
#else
constexpr int64_t kRows = 4;    // (16 ymm registers: past 4 rows the sums would spill)
#endif
constexpr int64_t kBlock = 320;  // bytes per tile group: 256 of codes, 16 float16 scales, 16 zeros

#ifdef EVOSPEC_VNNI

using evospec_vnni::kGroup;
using evospec_vnni::kTile;
using evospec_vnni::prefetch_weight;

// Rows 0..NR-1 of one tile: out[r * n + 0..15]. A group's integer dot products come from
// vnni.h's group_dots_u4 (exact: integer sums do not depend on their order), then each row's
// float epilogue adds the group in order.
template <int NR, typename Out>
void tile_rows(const uint8_t* packed, int64_t groups, const int8_t* codes, const float* ascale, const float* asum,
               int64_t k, Out* out, int64_t n, bool stream) {
  using namespace evospec_vnni;
  FV acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = fv_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wp = packed + g * kBlock;
    for (int b = 0; b < 5; ++b) prefetch_weight(wp, 64 * b, stream);  // (past the end: harmless)
    IV w[8];
    for (int b = 0; b < 4; ++b) {
      const IV v = iv_load(wp + 64 * b);
      w[2 * b] = nibbles_lo(v);
      w[2 * b + 1] = nibbles_hi(v);
    }
    const FV ws = fv_f16(wp + 256), wz = fv_f16(wp + 288);
    IV dots[NR];
    group_dots_u4<NR>(w, codes + g * kGroup, k, dots);
    for (int r = 0; r < NR; ++r) {
      const FV t = fv_add(fv_mul(ws, fv_cvt(dots[r])), fv_mul(wz, fv_set(asum[r * groups + g])));
      acc[r] = fv_add(acc[r], fv_mul(fv_set(ascale[r * groups + g]), t));
    }
  }
  for (int r = 0; r < NR; ++r) store_tile(out + r * n, acc[r]);
}

template <typename Out>
void tile_block(int64_t nr, const uint8_t* packed, int64_t groups, const int8_t* codes, const float* ascale,
                const float* asum, int64_t k, Out* out, int64_t n, bool stream) {
  switch (nr) {
    case 1: return tile_rows<1>(packed, groups, codes, ascale, asum, k, out, n, stream);
    case 2: return tile_rows<2>(packed, groups, codes, ascale, asum, k, out, n, stream);
    case 3: return tile_rows<3>(packed, groups, codes, ascale, asum, k, out, n, stream);
#if defined(EVOSPEC_ZMM)
    case 4: return tile_rows<4>(packed, groups, codes, ascale, asum, k, out, n, stream);
    case 5: return tile_rows<5>(packed, groups, codes, ascale, asum, k, out, n, stream);
    case 6: return tile_rows<6>(packed, groups, codes, ascale, asum, k, out, n, stream);
    case 7: return tile_rows<7>(packed, groups, codes, ascale, asum, k, out, n, stream);
    default: return tile_rows<8>(packed, groups, codes, ascale, asum, k, out, n, stream);
#else
    default: return tile_rows<4>(packed, groups, codes, ascale, asum, k, out, n, stream);
#endif
  }
}

#endif

#ifdef EVOSPEC_VNNI

// Output tiles [first, last) of x @ w^T for every row: the activations' codes (codes [m, k], scale
// and sum [m, k/32]) against packed [tiles, groups, 320], into out [m, n] (float32 or bf16);
// `stream`: the weight is read once a forward (vnni.h, prefetch_weight).
template <typename Out>
void tile_range(const uint8_t* packed, int64_t groups, int64_t first, int64_t last, const int8_t* codes,
                const float* ascale, const float* asum, int64_t m, int64_t k, Out* out, int64_t n, bool stream) {
  for (int64_t t = first; t < last; ++t) {
    const uint8_t* wt = packed + t * groups * kBlock;
    for (int64_t r0 = 0; r0 < m; r0 += kRows) {
      const int64_t nr = std::min(kRows, m - r0);
      tile_block(nr, wt, groups, codes + r0 * k, ascale + r0 * groups, asum + r0 * groups, k,
                 out + r0 * n + t * evospec_vnni::kTile, n, stream);
    }
  }
}

#endif

}  // namespace evospec_int4

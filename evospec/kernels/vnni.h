// Activation codes for the VNNI matmuls (int4_matmul.cpp, int8_matmul.cpp): one quantiser for both.
//
// Each row's group of 32 inputs becomes int8 codes by its own scale a = max|x| / 127 (rounded
// to nearest even, so |code| <= 127), as llama.cpp's Q8_0; with the scale go the group's code
// sum (for the weights' offsets) and the codes themselves. A row's codes depend on that row only.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EVOSPEC_VNNI 1

#include <ATen/ATen.h>
#include <immintrin.h>

#include "bf16.h"

#include <cstdint>
#include <vector>

namespace evospec_vnni {

constexpr int64_t kGroup = 32;  // input columns per activation scale (and per int4 weight group)
constexpr int64_t kTile = 16;   // output columns per zmm of int32 sums

// One row's groups: int8 codes (`k` bytes), the scale and the code sum of each group.
inline void quantize_row(const float* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi));  // nearest even (MXCSR default)
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup + 16), _mm512_cvtsepi32_epi8(c1));
    scale[g] = amax / 127.0f;
    sum[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
  }
}

// The codes of every row of x (float32 or bfloat16 [M, K], contiguous): codes [M, K], scale
// and code sum [M, K/32]. Quantised on the calling thread (~1 us a row; waking the pool would
// cost more), into buffers kept per calling thread; workers read them through these pointers.
struct ActivationCodes {
  const int8_t* codes;
  const float* scale;
  const float* sum;
};

inline ActivationCodes quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  thread_local std::vector<int8_t> codes_buf;
  thread_local std::vector<float> scale_buf, sum_buf, row;
  codes_buf.resize(m * k);
  scale_buf.resize(m * groups);
  sum_buf.resize(m * groups);
  row.resize(bf16 ? k : 0);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * k;
      for (int64_t i = 0; i < k; ++i) row[i] = evospec_bf16::bf16_to_f32(src[i]);
      xr = row.data();
    } else {
      xr = x.data_ptr<float>() + r * k;
    }
    quantize_row(xr, k, codes_buf.data() + r * k, scale_buf.data() + r * groups, sum_buf.data() + r * groups);
  }
  return {codes_buf.data(), scale_buf.data(), sum_buf.data()};
}

// Store 16 float32 sums as the output's dtype (float32, or bfloat16 rounded to nearest even).
template <typename Out>
inline void store_tile(Out* out, __m512 v) {
  if constexpr (sizeof(Out) == 4) {
    _mm512_storeu_ps(reinterpret_cast<float*>(out), v);
  } else {
    alignas(64) float f[kTile];
    _mm512_store_ps(f, v);
    for (int64_t i = 0; i < kTile; ++i) out[i] = evospec_bf16::f32_to_bf16(f[i]);
  }
}

}  // namespace evospec_vnni

#endif

// Row functions of the CPU ops (cpu_ops.cpp) and the one-op layer (llama_layer.cpp): one code for a
// row wherever it is computed, so both give the same bits. Built with -ffp-contract=off.
#pragma once

#include "bf16.h"
#include "fastexp.h"

#include <cmath>
#include <cstdint>

namespace evospec_rows {

using evospec_bf16::bf16_to_f32;
using evospec_bf16::f32_to_bf16;
using evospec_fastexp::exp_f32;

constexpr int kLanes = 8;

// 1 / sqrt(mean(x^2) + eps) over one row, summed in kLanes fixed partial sums.
inline float inv_rms(const float* x, int64_t d, float eps) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  for (int l = 0; i < d; ++i, ++l) acc[l] += x[i] * x[i];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return 1.0f / std::sqrt(s / static_cast<float>(d) + eps);
}

inline void norm_row(const float* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ out,
                     int64_t d, float eps) {
  float inv = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i) out[i] = f32_to_bf16(w[i] * (x[i] * inv));
}

// Kept out of line: inlined into silu_mul_bf16's loop, whose g and u point into one buffer, GCC 12
// dropped the restrict promise and left this loop scalar (6 ns an element instead of ~1).
__attribute__((noinline)) inline void silu_mul_row(const uint16_t* __restrict__ g,
                                                   const uint16_t* __restrict__ u, uint16_t* __restrict__ o,
                                                   int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gv = bf16_to_f32(g[i]);
    o[i] = f32_to_bf16(gv / (1.0f + exp_f32(-gv)) * bf16_to_f32(u[i]));
  }
}

// One head of one row of a qkv product (bf16 [Dh]) -> float32 dst [Dh]: a value head copied; a
// query or key head RMS-normed by w first where w is given (Gemma-3), then rotated (rotate-half
// RoPE by this row's cos / sin [Dh]). `row` is scratch of Dh floats.
inline void rope_head(const uint16_t* __restrict__ src, float* __restrict__ dst, const float* cr, const float* sr,
                      int64_t dh, bool value, const float* w, float eps, float* __restrict__ row) {
  const int64_t half = dh / 2;
  for (int64_t i = 0; i < dh; ++i) row[i] = bf16_to_f32(src[i]);
  if (value) {
    for (int64_t i = 0; i < dh; ++i) dst[i] = row[i];
    return;
  }
  if (w) {
    const float inv = inv_rms(row, dh, eps);
    for (int64_t i = 0; i < dh; ++i) row[i] = w[i] * (row[i] * inv);
  }
  for (int64_t i = 0; i < half; ++i) dst[i] = row[i] * cr[i] - row[i + half] * sr[i];
  for (int64_t i = half; i < dh; ++i) dst[i] = row[i] * cr[i] + row[i - half] * sr[i];
}

}  // namespace evospec_rows

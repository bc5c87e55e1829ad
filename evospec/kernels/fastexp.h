// exp(x) for float32 shared by the CPU ops (cpu_ops.cpp's SiLU, attention.cpp's softmax).
#pragma once

#include <bit>
#include <cstdint>

namespace evospec_fastexp {

// exp(x) for float32 by range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial
// (the classic Cephes coefficients), written branch-free so that loops over it vectorise.
inline float exp_f32(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float big = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const float n = (x * 1.44269504088896341f + big) - big;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

}  // namespace evospec_fastexp

// bfloat16 <-> float32 for the CPU ops (cpu_ops.cpp, int4_matmul.cpp): one rounding rule for all.
#pragma once

#include <bit>
#include <cstdint>

namespace evospec_bf16 {

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);  // a select, no branch
}

}  // namespace evospec_bf16

// Decode attention on the CPU (attention.cpp): declared here for cpu_ops.cpp's llama_layer.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace evospec_attention {

// q f32 [B, H, n, Dh]; keys, values f32 or f16 [B, Hk, S, Dh] (a contiguous last dim); mask
// (n = 1 only, optional) bool with S or B * S elements, True = attend -> f32 [B, H, n, Dh];
// row j sees the first S - n + 1 + j keys. See attention.cpp for the arithmetic.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale, int64_t window = 0);

}  // namespace evospec_attention

// One Llama decoder layer run by one team of threads (llama_layer.cpp): cpu_ops.cpp's llama_layer
// op takes this path where it applies and its op-by-op calls elsewhere; both give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace evospec_layer {

// Whether llama_layer_team serves these arguments (the VNNI build, a head size that is a multiple
// of 16, an f16 or f32 cache, contiguous rows and tables, cos / sin of [n, Dh]).
bool team_applies(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n);

// llama_layer's contract (cpu_ops.cpp), `end` the cache length after the layer.
std::tuple<at::Tensor, at::Tensor> llama_layer_team(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& post_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, int64_t end, int64_t b, int64_t n,
    int64_t hq, int64_t hk, double scale, double eps);

}  // namespace evospec_layer

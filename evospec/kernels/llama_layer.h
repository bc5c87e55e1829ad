// Llama decoder layers run by one team of threads (llama_layer.cpp): cpu_ops.cpp's llama_layer and
// llama_stack ops take this path where it applies and their op-by-op calls elsewhere; both give
// the same bits.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace evospec_layer {

// Whether the team serves a forward with these RoPE tables and caches (the VNNI build, a head size
// that is a multiple of 16, contiguous cos / sin of [n, Dh], an f16 or f32 cache) ...
bool tables_apply(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  int64_t n);

// ... and these rows (x float32, h bfloat16, contiguous): stack_team's arguments.
bool team_applies(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n);

// One layer of a stack: its cache layer, four packed int4 products, the post-attention norm and
// the next layer's input norm (none: the stack's last layer, which keeps its post-attention h).
struct StackLayer {
  int64_t layer;
  at::Tensor qkv, o, gate_up, down, post;
  std::optional<at::Tensor> next;
};

// Consecutive layers run by one team of threads, each with llama_layer's contract (cpu_ops.cpp);
// `end` is the cache length after them. Returns (x, h) after the last. `tree` (one sequence): the
// n rows are a draft tree's nodes, row j seeing the nodes of its bits (decode_attention_tree).
std::tuple<at::Tensor, at::Tensor> stack_team(const at::Tensor& x, const at::Tensor& h,
                                              const std::vector<StackLayer>& layers, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& k_cache,
                                              const at::Tensor& v_cache, int64_t end, int64_t b, int64_t n,
                                              int64_t hq, int64_t hk, double scale, double eps,
                                              const int64_t* tree = nullptr);

// Whether stack_seqs_team serves these rows: team_applies' terms for each sequence's cache (one
// sequence each, all of one element type) and RoPE tables of one row per sequence, [B, Dh].
bool seqs_apply(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                at::TensorList k_caches, at::TensorList v_caches);

// One new token of each of B sequences through consecutive layers, each sequence in caches of its
// own (k_caches[i], v_caches[i]: [L, 1, Hk, S_i, Dh]), its token at slot ends[i] - 1 and attending
// to slots [0, ends[i]) as a one-sequence step there does: row i's results are bitwise that step's.
// x [B, D] f32, h [B, D] bf16, cos / sin [B, Dh] (row i at sequence i's position).
std::tuple<at::Tensor, at::Tensor> stack_seqs_team(const at::Tensor& x, const at::Tensor& h,
                                                   const std::vector<StackLayer>& layers, const at::Tensor& cos,
                                                   const at::Tensor& sin, at::TensorList k_caches,
                                                   at::TensorList v_caches, at::IntArrayRef ends, int64_t hq,
                                                   int64_t hk, double scale, double eps);

// An EAGLE draft step by one team of threads: x = fc(pairs) (+ bias), then `layer` (no input norm,
// no next norm) -> its x [B n, D] float32. pairs [B n, 2 D] float32 ([embedding, feature] rows),
// fc packed int4; chain semantics and cache as llama_layer's.
at::Tensor draft_team(const at::Tensor& pairs, const at::Tensor& fc_w, const std::optional<at::Tensor>& fc_b,
                      const StackLayer& layer, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, int64_t end, int64_t b, int64_t n, int64_t hq, int64_t hk,
                      double scale, double eps);

}  // namespace evospec_layer

// Decode attention on the CPU (attention.cpp; its torch op: attention_op.cpp): declared here for
// llama_layer.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace evospec_attention {

constexpr int64_t kHeadQuantum = 16;  // the jobs take head sizes that are multiples of this
// Keys (and values) the attention prefetches ahead of the ones it is at (attention.cpp, prefetch_rows);
// 0: none. Run-time state of the op library (set_kv_ahead), for A/B runs; never changes a bit.
inline int64_t g_kv_ahead = 64;

// q f32 [B, H, n, Dh]; keys, values f32 or f16 [B, Hk, S, Dh] (a contiguous last dim); mask
// (n = 1 only, optional) bool with S or B * S elements, True = attend -> f32 [B, H, n, Dh];
// row j sees the first S - n + 1 + j keys. See attention.cpp for the arithmetic.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale, int64_t window = 0);

// decode_attention for the n rows of a draft tree written at the last n slots (parents before
// children): row j sees the keys before the tree and the tree nodes i whose bit i is set in
// tree[j] (its ancestors and itself: bit j set, none above it; n <= 64; no mask or window), with
// the bits of a one-token step that sees those keys laid out behind the prefix. Null: decode_attention.
at::Tensor decode_attention_tree(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const std::optional<at::Tensor>& mask, double scale, int64_t window,
                                 const int64_t* tree);

// An op's optional tree argument for n rows as decode_attention_tree takes it: null where absent;
// else checked (contiguous int64 [n], n <= 64, row j seeing itself and no later row), errors
// naming `op`.
const int64_t* tree_rows(const std::optional<at::Tensor>& tree, int64_t n, const char* op);

// One decode_attention call as jobs a caller runs on its own threads (llama_layer.cpp's team):
// any split of [0, jobs()) gives the op's bits. Pointers into q, out, keys and values (float32,
// or float16 keys and values; contiguous q and out, keys and values with a contiguous last dim,
// head size a multiple of 16); the mask as decode_attention takes it.
struct AttentionJobs {
  const float* q;
  float* out;
  const void* keys;
  const void* values;
  bool half;
  const bool* mask;
  bool per_batch;
  int64_t b, h, n, dh, hk, s;
  int64_t ks[3], vs[3];  // strides of the batch, head and slot dims
  float scale;
  int64_t window;
  int64_t rb, blocks, stride, grain;  // rows per block, blocks per KV head, score row stride, threading grain
  const int64_t* tree = nullptr;  // a draft tree's rows: per row j, the nodes it sees (decode_attention_tree)
  int64_t jobs() const { return b * hk * blocks; }
};

// The jobs of attention of q [B, H, n, Dh] (contiguous float32) into out (the same shape) over the
// first s slots of keys / values [B, Hk, >= s, Dh] (float32 or float16), planned for `threads`.
AttentionJobs plan_attention(const float* q, float* out, const at::Tensor& keys, const at::Tensor& values, int64_t h,
                             int64_t n, int64_t s, const bool* mask, bool per_batch, float scale, int64_t window,
                             int threads);
void run_attention_jobs(const AttentionJobs& jobs, int64_t first, int64_t last);

}  // namespace evospec_attention

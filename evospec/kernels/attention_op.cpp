// decode_attention's torch op (evospec::decode_attention) and its checks: attention.cpp holds the
// arithmetic, this file the arguments -- shapes, dtypes, a mask of one query row, a draft tree's
// bit sets -- and the padding of a head size that is not a multiple of 16 (tiny test models).
// Also set_kv_ahead(n) / kv_ahead(): how many keys ahead every attention of the library (this
// op's and the fused layers') prefetches keys and values (default 64; 0: none; no bit changes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "attention.h"

namespace evospec_attention {

const int64_t* tree_rows(const std::optional<at::Tensor>& tree, int64_t n, const char* op) {
  if (!tree.has_value() || !tree->defined()) return nullptr;
  TORCH_CHECK(tree->scalar_type() == at::kLong && tree->dim() == 1 && tree->size(0) == n && tree->is_contiguous() &&
                  n <= 64,
              op, ": tree must be contiguous int64 [n], n <= 64");
  const auto* bits = tree->data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK((static_cast<uint64_t>(bits[j]) >> j) == 1, op, ": tree row ", j, " must see itself and no later row");
  return bits;
}

at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const std::optional<at::Tensor>& mask, double scale, int64_t window,
                               const std::optional<at::Tensor>& tree) {
  TORCH_CHECK(q.dim() == 4, "decode_attention: q [B, H, n, Dh], keys/values [B, Hk, S, Dh]");
  return decode_attention_tree(q, keys, values, mask, scale, window, tree_rows(tree, q.size(2), "decode_attention"));
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale, int64_t window) {
  return decode_attention_tree(q, keys, values, mask, scale, window, nullptr);
}

at::Tensor decode_attention_tree(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                 const std::optional<at::Tensor>& mask, double scale, int64_t window,
                                 const int64_t* tree) {
  const auto kt = keys.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat && (kt == at::kFloat || kt == at::kHalf) && values.scalar_type() == kt,
              "decode_attention: q must be float32, keys and values both float32 or both float16");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q [B, H, n, Dh], keys/values [B, Hk, S, Dh]");
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), dh = q.size(3);
  const int64_t hk = keys.size(1), s = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && keys.size(3) == dh && hk > 0 && h % hk == 0 && n >= 1 && n <= s,
              "decode_attention: shapes of q and keys differ");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys need a contiguous last dim");
  TORCH_CHECK(window >= 0, "decode_attention: window must be >= 0");
  at::Tensor m;
  const bool* mp = nullptr;
  bool per_batch = false;
  if (mask.has_value() && mask->defined()) {
    m = mask->contiguous();
    TORCH_CHECK(n == 1 && m.scalar_type() == at::kBool && (m.numel() == s || m.numel() == b * s),
                "decode_attention: mask must be bool with S or B * S elements, for one query row");
    mp = m.data_ptr<bool>();
    per_batch = m.numel() == b * s && b > 1;
  }
  if (dh % kHeadQuantum) {  // zero lanes up to a multiple of 16 add exact zeros: the same sums, padded copies
    const int64_t pad = kHeadQuantum - dh % kHeadQuantum;
    return decode_attention_tree(at::constant_pad_nd(q, {0, pad}), at::constant_pad_nd(keys, {0, pad}),
                                 at::constant_pad_nd(values, {0, pad}), mask, scale, window, tree)
        .narrow(3, 0, dh)
        .contiguous();
  }
  auto qc = q.contiguous();
  auto out = at::empty({b, h, n, dh}, q.options());
  TORCH_CHECK(!tree || (!mp && window == 0 && n <= 64), "decode_attention: a tree takes no mask or window, <= 64 rows");
  auto jobs = plan_attention(qc.data_ptr<float>(), out.data_ptr<float>(), keys, values, h, n, s, mp, per_batch,
                             static_cast<float>(scale), window, at::get_num_threads());
  jobs.tree = tree;
  at::parallel_for(0, jobs.jobs(), jobs.grain,
                   [&](int64_t first, int64_t last) { run_attention_jobs(jobs, first, last); });
  return out;
}

// How many keys ahead the attention prefetches its keys and values (attention.h, g_kv_ahead; 0: none).
void set_kv_ahead(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= 4096, "set_kv_ahead: 0..4096 keys, got ", n);
  g_kv_ahead = n;
}

int64_t kv_ahead() { return g_kv_ahead; }

}  // namespace evospec_attention

TORCH_LIBRARY_FRAGMENT(evospec, m) {
  m.def("set_kv_ahead(int n) -> ()", &evospec_attention::set_kv_ahead);
  m.def("kv_ahead() -> int", &evospec_attention::kv_ahead);
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale, int window=0, "
        "Tensor? tree=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) { m.impl("decode_attention", &evospec_attention::decode_attention_op); }

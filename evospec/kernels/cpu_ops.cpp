// Fused elementwise ops of a decoder layer on the CPU, registered as torch ops (evospec::*).
//
// Contract (see cpu_ops.py for the Python side and the torch reference of each op):
//   rms_norm_bf16(x f32 [..., D], w f32 [D], eps)            -> bf16 [..., D]
//   add_rms_norm_bf16(x f32 [..., D], y [..., D], w, eps)    -> (x + y f32, rms_norm(x + y) bf16)
//   rope_qkv(qkv bf16 [B, n, (Hq + 2 Hk) Dh], cos, sin f32 [n, Dh] or [B, n, Dh], Hq, Hk)
//                                                          -> q f32 [B, Hq, n, Dh], k, v [B, Hk, n, Dh]
//   silu_mul_bf16(gu bf16 [..., 2 I])                       -> silu(gu[:I]) * gu[I:] bf16 [..., I]
//   llama_layer(...): one decoder layer (a step, a row-exact chain, causal prefill rows): the
//                     calls above plus attention.cpp's decode_attention and int4_matmul's, as
//                     fused.py's loop makes them (one team of threads: llama_layer.cpp)
//   llama_stack(...): a model's layers as one op, llama_layer's contract for each; with `tree`, the
//                     rows of a draft tree (each sees its ancestors: attention.h's decode_attention_tree)
//   llama_stack_seqs(...): one token of each of several sequences, each in its own caches
//   draft_step(...):  an EAGLE-2 draft head's step (fc, then its layer) as one op
//   draft_step_ids(...): draft_step from token ids, features and RoPE tables (its pairs built in the op)
//   embed_rows(codes int8 [V, D], scale f16 [V, D/32], ids int64 [...]) -> f32 [..., D]: rows of a
//                     compact embedding (models/embedding.py), each value code * its group's scale
// Gemma-3's blocks (norms after each sublayer too, q/k norms, GELU, sliding windows) add:
//   rope_qkv_normed(qkv, cos, sin, Hq, Hk, qw f32 [Dh], kw, eps)
//                                                          -> rope_qkv with each q and k head
//                                                             RMS-normed (by qw / kw) first
//   norm_add_rms_norm_bf16(x f32 [..., D], y, w, w_next, eps) -> (s = x + rms_norm(y) f32,
//                                                                 rms_norm(s) by w_next bf16)
//   gelu_mul_bf16(gu bf16 [..., 2 I])                       -> gelu_tanh(gu[:I]) * gu[I:] bf16
//   gemma_layer(...): one Gemma-3 decoder layer, as fused.py's Gemma loop makes its calls
// A Gemma norm's weight is 1 + w (fused.py precomputes it), so every norm here multiplies by
// the weight it is given.
//
// Every op computes each row (the last dimension) with the same code whatever the number of
// rows, in float32, rounding once to bfloat16 (nearest-even) at the end: a row's result never
// depends on which batch it came in, which keeps chain verification equal to plain decoding.
// Built with -ffp-contract=off, so vector bodies and scalar tails round alike.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include "attention.h"
#include "bf16.h"
#include "fastexp.h"
#include "llama_layer.h"
#include "rows.h"

#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <bit>
#include <algorithm>
#include <optional>
#include <vector>
#include <tuple>
#include <vector>

namespace {

using evospec_bf16::bf16_to_f32;
using evospec_bf16::f32_to_bf16;
using evospec_fastexp::exp_f32;

using evospec_rows::inv_rms;
using evospec_rows::norm_row;
using evospec_rows::silu_mul_row;

// x + w * (y * inv_rms(y)) over one row (y converted to float32 in `buf`): a Gemma sublayer's
// output normed and added to the residual stream.
inline void norm_add_row(const float* __restrict__ x, const float* __restrict__ y, const float* __restrict__ w,
                         float* __restrict__ out, int64_t d, float eps) {
  float inv = inv_rms(y, d, eps);
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] + w[i] * (y[i] * inv);
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), name, ": x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == x.size(-1), name,
              ": w must be float32 [D]");
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm_bf16");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) norm_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// The residual stream's update and the next norm, one row at a time: s = x + y, or with `post`
// (a Gemma sublayer's output norm) s = x + rms_norm(y) by post; then h = rms_norm(s) by w, bf16.
// y (bf16 or f32) is read as float32 (exactly) into a per-thread row buffer.
std::tuple<at::Tensor, at::Tensor> residual_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor* post,
                                                 const at::Tensor& w, double eps, const char* name) {
  check_rows(x, w, name);
  if (post) check_rows(x, *post, name);
  TORCH_CHECK(y.sizes() == x.sizes(), name, ": x and y differ in shape");
  auto yc = y.contiguous();
  TORCH_CHECK(yc.scalar_type() == at::kBFloat16 || yc.scalar_type() == at::kFloat, name,
              ": y must be bfloat16 or float32");
  const bool y_bf16 = yc.scalar_type() == at::kBFloat16;
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto sum = at::empty_like(x);
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  const float* pp = post ? post->contiguous().data_ptr<float>() : nullptr;
  float* sp = sum.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const void* yp = yc.data_ptr();
  const float f_eps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    thread_local std::vector<float> buf;
    if (y_bf16 && buf.size() < static_cast<size_t>(d)) buf.resize(d);
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * d;
      float* sr = sp + r * d;
      const float* yr = static_cast<const float*>(yp) + r * d;
      if (y_bf16) {
        const uint16_t* yh = static_cast<const uint16_t*>(yp) + r * d;
        for (int64_t i = 0; i < d; ++i) buf[i] = bf16_to_f32(yh[i]);
        yr = buf.data();
      }
      if (pp) {
        norm_add_row(xr, yr, pp, sr, d, f_eps);
      } else {
        for (int64_t i = 0; i < d; ++i) sr[i] = xr[i] + yr[i];
      }
      norm_row(sr, wp, op + r * d, d, f_eps);
    }
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& y,
                                                     const at::Tensor& w, double eps) {
  return residual_norm(x, y, nullptr, w, eps, "add_rms_norm_bf16");
}

std::tuple<at::Tensor, at::Tensor> norm_add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& y,
                                                          const at::Tensor& w, const at::Tensor& w_next,
                                                          double eps) {
  return residual_norm(x, y, &w, w_next, eps, "norm_add_rms_norm_bf16");
}
// rope_qkv, with each q / k head RMS-normed by qw / kw first where they are given.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_impl(const at::Tensor& qkv, const at::Tensor& cos,
                                                             const at::Tensor& sin, int64_t hq, int64_t hk,
                                                             const float* qw, const float* kw, float eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 3, "rope_qkv: qkv must be bfloat16 [B, n, F]");
  const int64_t b = qkv.size(0), n = qkv.size(1);
  const int64_t dh = cos.size(-1);
  TORCH_CHECK(dh <= 512, "rope_qkv: head_dim over 512");
  TORCH_CHECK(dh % 2 == 0 && qkv.size(2) == (hq + 2 * hk) * dh, "rope_qkv: qkv width is not (Hq + 2 Hk) Dh");
  auto c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.sizes() == c.sizes(), "rope_qkv: cos/sin must be float32 alike");
  TORCH_CHECK(c.numel() == n * dh || c.numel() == b * n * dh, "rope_qkv: cos must be [n, Dh] or [B, n, Dh]");
  const bool per_row = c.numel() == b * n * dh && b > 1;
  auto x = qkv.contiguous();
  auto opts = qkv.options().dtype(at::kFloat);
  auto q = at::empty({b, hq, n, dh}, opts), k = at::empty({b, hk, n, dh}, opts), v = at::empty({b, hk, n, dh}, opts);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t heads = hq + 2 * hk, width = heads * dh;
  at::parallel_for(0, b * n, 16, [&](int64_t a, int64_t e) {
    float row[512];
    for (int64_t bt = a; bt < e; ++bt) {
      const int64_t bi = bt / n, t = bt % n;
      const float* cr = cp + (per_row ? bt : t) * dh;
      const float* sr = sp + (per_row ? bt : t) * dh;
      for (int64_t h = 0; h < heads; ++h) {
        const uint16_t* src = xp + bt * width + h * dh;
        float* dst;
        if (h < hq) dst = qp + ((bi * hq + h) * n + t) * dh;
        else if (h < hq + hk) dst = kp + ((bi * hk + (h - hq)) * n + t) * dh;
        else dst = vp + ((bi * hk + (h - hq - hk)) * n + t) * dh;
        evospec_rows::rope_head(src, dst, cr, sr, dh, h >= hq + hk, h < hq ? qw : kw, eps, row);
      }
    }
  });
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t hq, int64_t hk) {
  return rope_qkv_impl(qkv, cos, sin, hq, hk, nullptr, nullptr, 0.0f);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_normed(const at::Tensor& qkv, const at::Tensor& cos,
                                                               const at::Tensor& sin, int64_t hq, int64_t hk,
                                                               const at::Tensor& qw, const at::Tensor& kw,
                                                               double eps) {
  const int64_t dh = cos.size(-1);
  for (const auto* w : {&qw, &kw})
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->dim() == 1 && w->size(0) == dh,
                "rope_qkv_normed: qw, kw must be contiguous float32 [Dh]");
  return rope_qkv_impl(qkv, cos, sin, hq, hk, qw.data_ptr<float>(), kw.data_ptr<float>(), static_cast<float>(eps));
}

// gelu_tanh(g) = 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), written as
// g / (1 + exp(-2 u)) (the same function) so that it shares SiLU's exp.
__attribute__((noinline)) void gelu_mul_row(const uint16_t* __restrict__ g, const uint16_t* __restrict__ u,
                                            uint16_t* __restrict__ o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gv = bf16_to_f32(g[i]);
    float arg = 1.5957691216057308f * (gv + 0.044715f * (gv * gv * gv));  // 2 u
    o[i] = f32_to_bf16(gv / (1.0f + exp_f32(-arg)) * bf16_to_f32(u[i]));
  }
}

template <void (*Row)(const uint16_t*, const uint16_t*, uint16_t*, int64_t)>
at::Tensor act_mul_bf16(const at::Tensor& gu, const char* name) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.size(-1) % 2 == 0, name, ": gu must be bfloat16 [..., 2 I]");
  auto x = gu.contiguous();
  const int64_t width = x.size(-1), inter = width / 2, rows = x.numel() / width;
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) Row(xp + r * width, xp + r * width + inter, op + r * inter, inter);
  });
  return out;
}

at::Tensor silu_mul_bf16(const at::Tensor& gu) { return act_mul_bf16<silu_mul_row>(gu, "silu_mul_bf16"); }
at::Tensor gelu_mul_bf16(const at::Tensor& gu) { return act_mul_bf16<gelu_mul_row>(gu, "gelu_mul_bf16"); }

// int4_matmul.cpp's op on a layer's weight: the target model's, streamed (read once a forward)
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("evospec::int4_matmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(x, packed, true);
}

// stack_team (llama_layer.cpp) serves the layers unless EVOSPEC_LAYER_TEAM=0 (read at each
// call, so that a benchmark can time both in one process): the op-by-op calls below, same bits.
bool layer_team_enabled() {
  const char* v = std::getenv("EVOSPEC_LAYER_TEAM");
  return !(v && v[0] == '0' && v[1] == 0);
}

// One Llama-style decoder layer of a step, row-exact chain or causal prefill, with int4 (VNNI) linears: the
// calls fused.py's layer loop makes, in its order and on the same data, so its bits are that
// loop's; as one op, a recorded step replays one node per layer instead of ~38. x f32 / h bf16
// [M = B n, D]: the residual stream and its norm; with end = slots.size(0) (models/step.py's slot
// tensor: the cache length after this step), the layer's K/V go to slots [end - n, end) of
// `layer` in k_cache / v_cache [L, B, Hk, S, Dh], and row j attends to the first end - n + 1 + j.
// Returns (x, h) after the layer (h normed by next_w; the last layer, without it, returns x + mlp
// and the post-attention h).
std::tuple<at::Tensor, at::Tensor> llama_layer_tree(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& post_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, const at::Tensor& slots, int64_t b,
    int64_t n, int64_t hq, int64_t hk, double scale, double eps, const int64_t* tree) {
  const int64_t end = slots.size(0);  // a tensor, not an int: a traced graph keeps its size symbolic
  TORCH_CHECK(x.dim() == 2 && x.size(0) == b * n && h.sizes() == x.sizes(), "llama_layer: x, h must be [B n, D]");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3),
              "llama_layer: the cache cannot hold these slots");
  if (layer_team_enabled() && evospec_layer::team_applies(x, h, cos, sin, k_cache, v_cache, n))
    return evospec_layer::stack_team(x, h, {{layer, qkv_w, o_w, gate_up_w, down_w, post_w, next_w}}, cos, sin,
                                     k_cache, v_cache, end, b, n, hq, hk, scale, eps, tree);
  auto [q, k, v] = rope_qkv(int4_rows(h, qkv_w).view({b, n, -1}), cos, sin, hq, hk);
  auto keys = k_cache.select(0, layer), values = v_cache.select(0, layer);  // [B, Hk, S, Dh]
  keys.narrow(2, end - n, n).copy_(k);
  values.narrow(2, end - n, n).copy_(v);
  auto out = evospec_attention::decode_attention_tree(q, keys.narrow(2, 0, end), values.narrow(2, 0, end),
                                                      std::nullopt, scale, 0, tree);
  out = out.transpose(1, 2).to(at::kBFloat16, false, false, at::MemoryFormat::Contiguous).view({b * n, -1});
  auto [x1, h1] = add_rms_norm_bf16(x, int4_rows(out, o_w), post_w, eps);
  auto mlp = int4_rows(silu_mul_bf16(int4_rows(h1, gate_up_w)), down_w);
  if (next_w.has_value() && next_w->defined()) return add_rms_norm_bf16(x1, mlp, *next_w, eps);
  return {x1 + mlp, h1};
}

std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& post_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, const at::Tensor& slots, int64_t b,
    int64_t n, int64_t hq, int64_t hk, double scale, double eps) {
  return llama_layer_tree(x, h, qkv_w, o_w, gate_up_w, down_w, post_w, next_w, cos, sin, k_cache, v_cache, layer,
                          slots, b, n, hq, hk, scale, eps, nullptr);
}


// Layers 0..L-1 of a model as one op (llama_stack): llama_layer's contract for each, the input norm
// of layer i + 1 (next_ws[i], L - 1 of them) normed into h after layer i, and the last layer's
// post-attention h returned with its x. One team of threads runs them all (llama_layer.cpp); where
// it does not apply, llama_layer one after another. A recorded step replays one node for them.
std::tuple<at::Tensor, at::Tensor> llama_stack(
    const at::Tensor& x, const at::Tensor& h, at::TensorList qkv_ws, at::TensorList o_ws, at::TensorList gate_up_ws,
    at::TensorList down_ws, at::TensorList post_ws, at::TensorList next_ws, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
    int64_t b, int64_t n, int64_t hq, int64_t hk, double scale, double eps, const std::optional<at::Tensor>& tree) {
  const size_t count = qkv_ws.size();
  TORCH_CHECK(!(tree.has_value() && tree->defined()) || b == 1, "llama_stack: a tree is one sequence's");
  const int64_t* bits = evospec_attention::tree_rows(tree, n, "llama_stack");
  TORCH_CHECK(count >= 1 && o_ws.size() == count && gate_up_ws.size() == count && down_ws.size() == count &&
                  post_ws.size() == count && next_ws.size() + 1 == count,
              "llama_stack: L weights of each kind and L - 1 next norms");
  const int64_t end = slots.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == b * n && h.sizes() == x.sizes(), "llama_stack: x, h must be [B n, D]");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3) &&
                  static_cast<int64_t>(count) <= k_cache.size(0),
              "llama_stack: the cache cannot hold these slots");
  if (layer_team_enabled() && evospec_layer::team_applies(x, h, cos, sin, k_cache, v_cache, n)) {
    std::vector<evospec_layer::StackLayer> layers;
    for (size_t i = 0; i < count; ++i)
      layers.push_back({static_cast<int64_t>(i), qkv_ws[i], o_ws[i], gate_up_ws[i], down_ws[i], post_ws[i],
                        i + 1 < count ? std::optional<at::Tensor>(next_ws[i]) : std::nullopt});
    return evospec_layer::stack_team(x, h, layers, cos, sin, k_cache, v_cache, end, b, n, hq, hk, scale, eps, bits);
  }
  at::Tensor xi = x, hi = h;
  for (size_t i = 0; i < count; ++i) {
    const auto next = i + 1 < count ? std::optional<at::Tensor>(next_ws[i]) : std::nullopt;
    std::tie(xi, hi) = llama_layer_tree(xi, hi, qkv_ws[i], o_ws[i], gate_up_ws[i], down_ws[i], post_ws[i], next, cos,
                                        sin, k_cache, v_cache, static_cast<int64_t>(i), slots, b, n, hq, hk, scale,
                                        eps, bits);
  }
  return {xi, hi};
}

// One new token of each of B sequences through layers 0..L-1 (llama_stack_seqs; models/batch_step.py):
// sequence i keeps its own caches (k_caches[i], v_caches[i]: [L, 1, Hk, S_i, Dh]), its row writes
// slot ends[i] - 1 and attends to slots [0, ends[i]), and every row's bits are those of a
// one-sequence llama_stack step at that length: the products and elementwise steps are row-exact,
// and each sequence's attention runs on the plan its own step makes. x f32 / h bf16 [B, D]; cos,
// sin [B, Dh]. One team of threads runs all rows (the products read each weight once for B rows);
// where it does not apply, llama_stack for each sequence in turn (the same bits, no sharing).
std::tuple<at::Tensor, at::Tensor> llama_stack_seqs(
    const at::Tensor& x, const at::Tensor& h, at::TensorList qkv_ws, at::TensorList o_ws, at::TensorList gate_up_ws,
    at::TensorList down_ws, at::TensorList post_ws, at::TensorList next_ws, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef ends, int64_t hq,
    int64_t hk, double scale, double eps) {
  const size_t count = qkv_ws.size();
  const int64_t b = x.dim() == 2 ? x.size(0) : 0;
  TORCH_CHECK(count >= 1 && o_ws.size() == count && gate_up_ws.size() == count && down_ws.size() == count &&
                  post_ws.size() == count && next_ws.size() + 1 == count,
              "llama_stack_seqs: L weights of each kind and L - 1 next norms");
  TORCH_CHECK(b >= 1 && h.sizes() == x.sizes(), "llama_stack_seqs: x, h must be [B, D]");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == b && static_cast<int64_t>(v_caches.size()) == b &&
                  static_cast<int64_t>(ends.size()) == b,
              "llama_stack_seqs: one K cache, V cache and end per row");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == b && sin.sizes() == cos.sizes(),
              "llama_stack_seqs: cos, sin must be [B, Dh]");
  for (int64_t i = 0; i < b; ++i) {
    const auto &kc = k_caches[i], &vc = v_caches[i];
    TORCH_CHECK(kc.dim() == 5 && kc.size(1) == 1 && vc.sizes() == kc.sizes() && ends[i] >= 1 &&
                    ends[i] <= kc.size(3) && static_cast<int64_t>(count) <= kc.size(0),
                "llama_stack_seqs: sequence ", i, "'s cache cannot hold slot ", ends[i] - 1);
  }
  if (layer_team_enabled() && evospec_layer::seqs_apply(x, h, cos, sin, k_caches, v_caches)) {
    std::vector<evospec_layer::StackLayer> layers;
    for (size_t i = 0; i < count; ++i)
      layers.push_back({static_cast<int64_t>(i), qkv_ws[i], o_ws[i], gate_up_ws[i], down_ws[i], post_ws[i],
                        i + 1 < count ? std::optional<at::Tensor>(next_ws[i]) : std::nullopt});
    return evospec_layer::stack_seqs_team(x, h, layers, cos, sin, k_caches, v_caches, ends, hq, hk, scale, eps);
  }
  std::vector<at::Tensor> xs, hs;
  for (int64_t i = 0; i < b; ++i) {
    auto slots = at::empty({ends[i]}, x.options().dtype(at::kByte));
    auto [xi, hi] = llama_stack(x.narrow(0, i, 1), h.narrow(0, i, 1), qkv_ws, o_ws, gate_up_ws, down_ws, post_ws,
                                next_ws, cos.narrow(0, i, 1).contiguous(), sin.narrow(0, i, 1).contiguous(),
                                k_caches[i], v_caches[i], slots, 1, 1, hq, hk, scale, eps, std::nullopt);
    xs.push_back(xi);
    hs.push_back(hi);
  }
  return {at::cat(xs), at::cat(hs)};
}

// An EAGLE-2 draft step (fused.py's draft heads): x = fc([embedding, feature] rows) (+ bias), then
// the head's one layer without an input norm, as one team of threads (llama_layer.cpp: int4
// products, the cache written and attended as llama_layer does) -> x [B n, D] float32.
at::Tensor draft_step(const at::Tensor& pairs, const at::Tensor& fc_w, const std::optional<at::Tensor>& fc_b,
                      const at::Tensor& qkv_w, const at::Tensor& o_w, const at::Tensor& gate_up_w,
                      const at::Tensor& down_w, const at::Tensor& post_w, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, int64_t b,
                      int64_t n, int64_t hq, int64_t hk, double scale, double eps) {
  const int64_t end = slots.size(0);
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3),
              "draft_step: the cache cannot hold these slots");
  TORCH_CHECK(evospec_layer::tables_apply(cos, sin, k_cache, v_cache, n),
              "draft_step: needs the VNNI build, a head size that is a multiple of 16 and an f16 or f32 cache");
  return evospec_layer::draft_team(pairs, fc_w, fc_b, {0, qkv_w, o_w, gate_up_w, down_w, post_w, std::nullopt}, cos,
                                   sin, k_cache, v_cache, end, b, n, hq, hk, scale, eps);
}

// Row `id` of a token embedding as float32 into out [d]: a float32 table's row, or (scale given)
// an int8 table's codes, each times its group of 32's float16 scale (models/embedding.py: a GGUF
// Q8_0 table's values, which those products give exactly).
void embedding_row(const at::Tensor& table, const std::optional<at::Tensor>& scale, int64_t id, float* out) {
  const int64_t d = table.size(1);
  if (!scale.has_value()) {
    std::memcpy(out, table.data_ptr<float>() + id * d, d * sizeof(float));
    return;
  }
  const int8_t* codes = table.data_ptr<int8_t>() + id * d;
  const c10::Half* s = scale->data_ptr<c10::Half>() + id * (d / 32);
  for (int64_t g = 0; g < d / 32; ++g) {
    const float sg = static_cast<float>(s[g]);
    for (int64_t i = 0; i < 32; ++i) out[g * 32 + i] = sg * static_cast<float>(codes[g * 32 + i]);
  }
}

// What embedding_row reads: a contiguous float32 [V, D] table, or (scale given) contiguous int8
// codes [V, D] with D a multiple of 32 and their float16 scales [V, D / 32].
void check_embedding(const at::Tensor& table, const std::optional<at::Tensor>& scale, const char* op) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous(), op, ": the embedding must be a contiguous [V, D] table");
  if (!scale.has_value()) {
    TORCH_CHECK(table.scalar_type() == at::kFloat, op, ": an embedding without scales must be float32");
    return;
  }
  TORCH_CHECK(table.scalar_type() == at::kChar && table.size(1) % 32 == 0, op,
              ": a scaled embedding must be int8 codes [V, D], D a multiple of 32");
  TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->dim() == 2 &&
                  scale->size(0) == table.size(0) && scale->size(1) == table.size(1) / 32,
              op, ": the embedding's scales must be contiguous float16 [V, D / 32]");
}

at::Tensor embed_rows(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& ids) {
  check_embedding(codes, scale, "embed_rows");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "embed_rows: ids must be int64");
  const auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.size(0), d = codes.size(1), vocab = codes.size(0);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(d);
  auto out = at::empty(shape, codes.options().dtype(at::kFloat));
  const int64_t* p = flat.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const std::optional<at::Tensor> s = scale;
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(p[j] >= 0 && p[j] < vocab, "embed_rows: token ", p[j], " is outside the vocabulary");
    embedding_row(codes, s, p[j], o + j * d);
  }
  return out;
}

// draft_step's rows built in the op: row j of the pairs is [embedding[tokens[j]], features[j]] and
// its RoPE row is table row first + j (positions first, first + 1, ...: a chain step, or a
// catch-up of consecutive pairs); writes slots end - n .. end - 1 of the cache. One dispatch
// where the recorded step ran ~10 (the embedding, the cast and concatenation, RoPE's table):
// after a target forward each of those ran cold. One sequence (B = 1).
at::Tensor draft_step_ids(const at::Tensor& features, const at::Tensor& tokens, const at::Tensor& embedding,
                          const at::Tensor& cos_table, const at::Tensor& sin_table, int64_t first,
                          const at::Tensor& fc_w, const std::optional<at::Tensor>& fc_b, const at::Tensor& qkv_w,
                          const at::Tensor& o_w, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                          const at::Tensor& post_w, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t end,
                          int64_t hq, int64_t hk, double scale, double eps,
                          const std::optional<at::Tensor>& embedding_scale) {
  const int64_t n = tokens.size(0), d = embedding.size(1), vocab = embedding.size(0);
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && n >= 1, "draft_step_ids: tokens must be int64 [n]");
  check_embedding(embedding, embedding_scale, "draft_step_ids");
  TORCH_CHECK(features.dim() == 2 && features.scalar_type() == at::kFloat && features.size(0) == n &&
                  features.size(1) == d && features.stride(1) == 1,
              "draft_step_ids: features must be float32 [n, D] with unit column stride");
  TORCH_CHECK(cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes() && first >= 0 &&
                  first + n <= cos_table.size(0),
              "draft_step_ids: the RoPE tables have no rows for positions ", first, "..", first + n - 1);
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3),
              "draft_step_ids: the cache cannot hold these slots");
  auto cos = cos_table.narrow(0, first, n), sin = sin_table.narrow(0, first, n);  // contiguous rows
  TORCH_CHECK(evospec_layer::tables_apply(cos, sin, k_cache, v_cache, n),
              "draft_step_ids: needs the VNNI build, a head size that is a multiple of 16 and an f16 or f32 cache");
  auto pairs = at::empty({n, 2 * d}, features.options());
  const int64_t* ids = tokens.data_ptr<int64_t>();
  const float* feat = features.data_ptr<float>();
  float* out = pairs.data_ptr<float>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(ids[j] >= 0 && ids[j] < vocab, "draft_step_ids: token ", ids[j], " is outside the vocabulary");
    embedding_row(embedding, embedding_scale, ids[j], out + j * 2 * d);
    std::memcpy(out + j * 2 * d + d, feat + j * features.stride(0), d * sizeof(float));
  }
  return evospec_layer::draft_team(pairs, fc_w, fc_b, {0, qkv_w, o_w, gate_up_w, down_w, post_w, std::nullopt}, cos,
                                   sin, k_cache, v_cache, end, 1, n, hq, hk, scale, eps);
}

// One Gemma-3 decoder layer, as fused.py's Gemma loop makes its calls (llama_layer's contract
// otherwise): h is x normed by this layer's input norm; the q/k heads are normed before RoPE;
// attention hides keys `window` or more behind (a sliding layer; 0: a global one); each
// sublayer's output is normed (post_w, post_ff_w) before it joins the residual stream; the MLP
// is GELU-gated. Every *_w norm weight is Gemma's 1 + w.
std::tuple<at::Tensor, at::Tensor> gemma_layer(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
    const at::Tensor& post_w, const at::Tensor& pre_ff_w, const at::Tensor& post_ff_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, int64_t layer, const at::Tensor& slots, int64_t b, int64_t n, int64_t hq, int64_t hk,
    double scale, double eps, int64_t window) {
  const int64_t end = slots.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == b * n && h.sizes() == x.sizes(), "gemma_layer: x, h must be [B n, D]");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3),
              "gemma_layer: the cache cannot hold these slots");
  auto [q, k, v] = rope_qkv_normed(int4_rows(h, qkv_w).view({b, n, -1}), cos, sin, hq, hk, q_norm_w, k_norm_w, eps);
  auto keys = k_cache.select(0, layer), values = v_cache.select(0, layer);  // [B, Hk, S, Dh]
  keys.narrow(2, end - n, n).copy_(k);
  values.narrow(2, end - n, n).copy_(v);
  auto out = evospec_attention::decode_attention(q, keys.narrow(2, 0, end), values.narrow(2, 0, end),
                                                 std::nullopt, scale, window);
  out = out.transpose(1, 2).to(at::kBFloat16, false, false, at::MemoryFormat::Contiguous).view({b * n, -1});
  auto [x1, h1] = norm_add_rms_norm_bf16(x, int4_rows(out, o_w), post_w, pre_ff_w, eps);
  auto mlp = int4_rows(gelu_mul_bf16(int4_rows(h1, gate_up_w)), down_w);
  const bool last = !(next_w.has_value() && next_w->defined());
  auto [x2, h2] = norm_add_rms_norm_bf16(x1, mlp, post_ff_w, last ? pre_ff_w : *next_w, eps);
  return {x2, last ? h1 : h2};
}

}  // namespace

TORCH_LIBRARY(evospec, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor y, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int hq, int hk) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
  m.def("llama_stack(Tensor x, Tensor h, Tensor[] qkv_ws, Tensor[] o_ws, Tensor[] gate_up_ws, Tensor[] down_ws, "
        "Tensor[] post_ws, Tensor[] next_ws, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "int b, int n, int hq, int hk, float scale, float eps, Tensor? tree=None) -> (Tensor, Tensor)");
  m.def("llama_stack_seqs(Tensor x, Tensor h, Tensor[] qkv_ws, Tensor[] o_ws, Tensor[] gate_up_ws, "
        "Tensor[] down_ws, Tensor[] post_ws, Tensor[] next_ws, Tensor cos, Tensor sin, Tensor[] k_caches, "
        "Tensor[] v_caches, int[] ends, int hq, int hk, float scale, float eps) -> (Tensor, Tensor)");
  m.def("draft_step(Tensor pairs, Tensor fc_w, Tensor? fc_b, Tensor qkv_w, Tensor o_w, Tensor gate_up_w, "
        "Tensor down_w, Tensor post_w, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, Tensor slots, int b, "
        "int n, int hq, int hk, float scale, float eps) -> Tensor");
  m.def("draft_step_ids(Tensor features, Tensor tokens, Tensor embedding, Tensor cos_table, Tensor sin_table, "
        "int first, Tensor fc_w, Tensor? fc_b, Tensor qkv_w, Tensor o_w, Tensor gate_up_w, Tensor down_w, "
        "Tensor post_w, Tensor k_cache, Tensor v_cache, int end, int hq, int hk, float scale, float eps, "
        "Tensor? embedding_scale=None) -> Tensor");
  m.def("embed_rows(Tensor codes, Tensor scale, Tensor ids) -> Tensor");
  m.def("llama_layer(Tensor x, Tensor h, Tensor qkv_w, Tensor o_w, Tensor gate_up_w, Tensor down_w, "
        "Tensor post_w, Tensor? next_w, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int layer, Tensor slots, int b, int n, int hq, int hk, float scale, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv_normed(Tensor qkv, Tensor cos, Tensor sin, int hq, int hk, Tensor qw, Tensor kw, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("norm_add_rms_norm_bf16(Tensor x, Tensor y, Tensor w, Tensor w_next, float eps) -> (Tensor, Tensor)");
  m.def("gelu_mul_bf16(Tensor gu) -> Tensor");
  m.def("gemma_layer(Tensor x, Tensor h, Tensor qkv_w, Tensor o_w, Tensor gate_up_w, Tensor down_w, "
        "Tensor q_norm_w, Tensor k_norm_w, Tensor post_w, Tensor pre_ff_w, Tensor post_ff_w, Tensor? next_w, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, Tensor slots, int b, int n, "
        "int hq, int hk, float scale, float eps, int window) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("llama_layer", &llama_layer);
  m.impl("llama_stack", &llama_stack);
  m.impl("llama_stack_seqs", &llama_stack_seqs);
  m.impl("draft_step", &draft_step);
  m.impl("draft_step_ids", &draft_step_ids);
  m.impl("embed_rows", &embed_rows);
  m.impl("rope_qkv_normed", &rope_qkv_normed);
  m.impl("norm_add_rms_norm_bf16", &norm_add_rms_norm_bf16);
  m.impl("gelu_mul_bf16", &gelu_mul_bf16);
  m.impl("gemma_layer", &gemma_layer);
}

// One Llama decoder layer run by one team of threads: llama_layer's calls without their dispatch.
//
// The op-by-op layer (cpu_ops.cpp's llama_layer elsewhere) makes ~15 calls: each allocates its
// output and goes through the dispatcher, the four int4 matmuls and the attention each start the
// thread pool, and while one thread quantises, rotates, norms and dispatches between them the
// others wait. A SmolLM2 step spent ~22% of its main thread there (perf, wave 25). Here one
// parallel region runs the whole layer: its threads split each phase -- a matmul's output tiles,
// the attention's jobs, the rows of the elementwise steps -- and meet at a barrier between
// phases, in buffers the calling thread keeps from call to call:
//
//   codes(h) | qkv tiles | RoPE rows, K/V into the cache | attention jobs | codes(bf16(attn))
//   | o tiles | x1 = x + o, h1 = norm(x1), codes(h1) | gate_up tiles | codes(silu(g) u)
//   | down tiles | x2 = x1 + mlp, h2 = norm(x2)
//
// Each phase computes a row with the code of the op it replaces (int4_tiles.h, rows.h,
// attention.h, vnni.h), and no row depends on how the threads split the work, so the results
// are bitwise the op-by-op layer's (tests/models/test_fused.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "attention.h"
#include "bf16.h"
#include "int4_tiles.h"
#include "llama_layer.h"
#include "rows.h"
#include "vnni.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef EVOSPEC_VNNI
#include <omp.h>
#endif

namespace evospec_layer {

#ifdef EVOSPEC_VNNI
namespace {

using evospec_bf16::bf16_to_f32;
using evospec_bf16::f32_to_bf16;
using evospec_vnni::kGroup;
using evospec_vnni::kTile;

struct Span {
  int64_t first, last;
};

// Thread tid's part of [0, total): `team` contiguous parts of near-equal size.
Span share(int64_t total, int tid, int team) {
  const int64_t per = total / team, extra = total % team;
  const int64_t first = tid * per + std::min<int64_t>(tid, extra);
  return {first, first + per + (tid < extra ? 1 : 0)};
}

// A packed int4 weight [tiles, groups, 320]: its output width is tiles * 16, its input groups * 32.
struct Weight {
  const uint8_t* data;
  int64_t tiles, groups;
  explicit Weight(const at::Tensor& w) : data(w.data_ptr<uint8_t>()), tiles(w.size(0)), groups(w.size(1)) {}
  int64_t out() const { return tiles * kTile; }
  int64_t in() const { return groups * kGroup; }
};

bool packed_int4(const at::Tensor& w) {
  return w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == evospec_int4::kBlock && w.is_contiguous();
}

bool norm_weight(const at::Tensor& w, int64_t d) {
  return w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == d && w.is_contiguous();
}

// The calling thread's buffers, grown as needed and kept between calls (one layer after another).
struct Scratch {
  std::vector<int8_t> codes;  // activation codes of the matmul's input rows [M, K]
  std::vector<float> scale, sum;  // [M, K / 32]
  std::vector<uint16_t> qkv, o, gu, act, mlp, h1;  // bf16 products and activations
  std::vector<float> q, attn, x1;  // rotated queries, attention output [B, Hq, n, Dh]; residual [M, D]
};

// The activation codes of rows [first, last) of a matmul input, as evospec_vnni::quantize_rows
// makes them: each row read as float32 (`load(r, buf)`), then quantize_row.
struct Codes {
  int8_t* codes;
  float* scale;
  float* sum;
  void row(const float* x, int64_t r, int64_t k) const {
    evospec_vnni::quantize_row(x, k, codes + r * k, scale + r * (k / kGroup), sum + r * (k / kGroup));
  }
};

inline void to_f32(const uint16_t* src, int64_t k, float* dst) {
  for (int64_t i = 0; i < k; ++i) dst[i] = bf16_to_f32(src[i]);
}

// Rows' products of one weight over the codes: thread tid's share of the output tiles.
void matmul(const Weight& w, const Codes& c, int64_t m, uint16_t* out, int tid, int team) {
  const Span s = share(w.tiles, tid, team);
  evospec_int4::tile_range(w.data, w.groups, s.first, s.last, c.codes, c.scale, c.sum, m, w.in(), out, w.out());
}

// A new K or V row of Dh floats into the cache (float16: rounded to nearest even, as copy_ does).
inline void put(void* cache, bool half, int64_t at, const float* src, int64_t dh) {
  if (half) {
    auto* dst = static_cast<c10::Half*>(cache) + at;
    for (int64_t i = 0; i < dh; ++i) dst[i] = c10::Half(src[i]);
  } else {
    std::copy(src, src + dh, static_cast<float*>(cache) + at);
  }
}

}  // namespace
#endif

bool team_applies(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n) {
#ifndef EVOSPEC_VNNI
  return false;
#else
  const auto kt = k_cache.scalar_type();
  const int64_t dh = cos.size(-1);
  return x.scalar_type() == at::kFloat && x.is_contiguous() && h.scalar_type() == at::kBFloat16 &&
         h.is_contiguous() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
         cos.is_contiguous() && sin.is_contiguous() && cos.numel() == n * dh && sin.numel() == n * dh &&
         dh % 16 == 0 && dh <= 512 && (kt == at::kHalf || kt == at::kFloat) && v_cache.scalar_type() == kt &&
         k_cache.dim() == 5 && k_cache.size(4) == dh && k_cache.stride(4) == 1 && v_cache.stride(4) == 1;
#endif
}

std::tuple<at::Tensor, at::Tensor> llama_layer_team(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& post_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, int64_t end, int64_t b, int64_t n,
    int64_t hq, int64_t hk, double scale, double eps) {
#ifndef EVOSPEC_VNNI
  TORCH_CHECK(false, "llama_layer_team: this build has no AVX-512 VNNI kernel");
  return {x, h};
#else
  const int64_t m = b * n, d = x.size(1), dh = cos.size(-1);
  for (const auto* w : {&qkv_w, &o_w, &gate_up_w, &down_w})
    TORCH_CHECK(packed_int4(*w), "llama_layer: weights must be contiguous uint8 [N/16, K/32, 320]");
  const Weight wqkv(qkv_w), wo(o_w), wgu(gate_up_w), wdown(down_w);
  const int64_t inter = wgu.out() / 2;
  TORCH_CHECK(wqkv.in() == d && wqkv.out() == (hq + 2 * hk) * dh && wo.in() == hq * dh && wo.out() == d &&
                  wgu.in() == d && wdown.in() == inter && wdown.out() == d,
              "llama_layer: weight shapes do not match the layer's sizes");
  const bool has_next = next_w.has_value() && next_w->defined();
  TORCH_CHECK(norm_weight(post_w, d) && (!has_next || norm_weight(*next_w, d)),
              "llama_layer: norm weights must be contiguous float32 [D]");

  thread_local Scratch sc;
  const int64_t kmax = std::max({d, hq * dh, inter});
  sc.codes.resize(m * kmax);
  sc.scale.resize(m * kmax / kGroup);
  sc.sum.resize(m * kmax / kGroup);
  sc.qkv.resize(m * wqkv.out());
  sc.o.resize(m * d);
  sc.gu.resize(m * 2 * inter);
  sc.act.resize(m * inter);
  sc.mlp.resize(m * d);
  sc.h1.resize(m * d);
  sc.q.resize(m * hq * dh);
  sc.attn.resize(m * hq * dh);
  sc.x1.resize(m * d);
  auto x_out = at::empty_like(x), h_out = at::empty_like(h);

  // the caller's buffers, by pointer: inside the region `sc` would name each thread's own
  const Codes codes{sc.codes.data(), sc.scale.data(), sc.sum.data()};
  uint16_t *qkv = sc.qkv.data(), *o = sc.o.data(), *gu_all = sc.gu.data(), *act = sc.act.data();
  uint16_t *mlp = sc.mlp.data(), *h1_all = sc.h1.data();
  float *qbuf = sc.q.data(), *attn = sc.attn.data(), *x1_all = sc.x1.data();
  const float* xp = x.data_ptr<float>();
  const auto* hp = reinterpret_cast<const uint16_t*>(h.data_ptr<at::BFloat16>());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float* post = post_w.data_ptr<float>();
  const float* next = has_next ? next_w->data_ptr<float>() : nullptr;
  float* xo = x_out.data_ptr<float>();
  auto* ho = reinterpret_cast<uint16_t*>(h_out.data_ptr<at::BFloat16>());
  const bool half = k_cache.scalar_type() == at::kHalf;
  const int64_t esize = half ? 2 : 4;
  auto* kbase = static_cast<char*>(k_cache.data_ptr()) + layer * k_cache.stride(0) * esize;
  auto* vbase = static_cast<char*>(v_cache.data_ptr()) + layer * v_cache.stride(0) * esize;
  const float f_eps = static_cast<float>(eps);
  const int team_size = at::get_num_threads();

  evospec_attention::AttentionJobs att;
  att.q = qbuf;
  att.out = attn;
  att.keys = kbase;
  att.values = vbase;
  att.half = half;
  att.mask = nullptr;
  att.per_batch = false;
  att.b = b, att.h = hq, att.n = n, att.dh = dh, att.hk = hk, att.s = end;
  for (int i = 0; i < 3; ++i) att.ks[i] = k_cache.stride(i + 1), att.vs[i] = v_cache.stride(i + 1);
  att.scale = static_cast<float>(scale);
  att.window = 0;
  evospec_attention::plan_attention(att, team_size);

#pragma omp parallel num_threads(team_size)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    thread_local std::vector<float> buf;  // one row as float32
    if (buf.size() < static_cast<size_t>(kmax + dh)) buf.resize(kmax + dh);
    const Span rows = share(m, tid, team);

    for (int64_t r = rows.first; r < rows.last; ++r) {  // codes(h)
      to_f32(hp + r * d, d, buf.data());
      codes.row(buf.data(), r, d);
    }
#pragma omp barrier
    matmul(wqkv, codes, m, qkv, tid, team);
#pragma omp barrier
    for (int64_t r = rows.first; r < rows.last; ++r) {  // RoPE; K/V rows into the cache
      const int64_t bi = r / n, t = r % n, slot = end - n + t;
      const float *cr = cp + t * dh, *sr = sp + t * dh;
      float* kv = buf.data() + dh;
      for (int64_t head = 0; head < hq + 2 * hk; ++head) {
        const uint16_t* src = qkv + r * wqkv.out() + head * dh;
        if (head < hq) {
          evospec_rows::rope_head(src, qbuf + ((bi * hq + head) * n + t) * dh, cr, sr, dh, false, nullptr,
                                  0.0f, buf.data());
          continue;
        }
        const bool value = head >= hq + hk;
        const int64_t g = value ? head - hq - hk : head - hq;
        evospec_rows::rope_head(src, kv, cr, sr, dh, value, nullptr, 0.0f, buf.data());
        const int64_t* st = value ? att.vs : att.ks;
        put(value ? vbase : kbase, half, bi * st[0] + g * st[1] + slot * st[2], kv, dh);
      }
    }
#pragma omp barrier
    const Span jobs = share(att.jobs(), tid, team);
    evospec_attention::run_attention_jobs(att, jobs.first, jobs.last);
#pragma omp barrier
    for (int64_t r = rows.first; r < rows.last; ++r) {  // codes(bf16(attention)), heads side by side
      const int64_t bi = r / n, t = r % n;
      for (int64_t head = 0; head < hq; ++head) {
        const float* src = attn + ((bi * hq + head) * n + t) * dh;
        for (int64_t i = 0; i < dh; ++i) buf[head * dh + i] = bf16_to_f32(f32_to_bf16(src[i]));
      }
      codes.row(buf.data(), r, hq * dh);
    }
#pragma omp barrier
    matmul(wo, codes, m, o, tid, team);
#pragma omp barrier
    for (int64_t r = rows.first; r < rows.last; ++r) {  // x1 = x + o, h1 = norm(x1), codes(h1)
      float* x1 = x1_all + r * d;
      for (int64_t i = 0; i < d; ++i) x1[i] = xp[r * d + i] + bf16_to_f32(o[r * d + i]);
      evospec_rows::norm_row(x1, post, h1_all + r * d, d, f_eps);
      to_f32(h1_all + r * d, d, buf.data());
      codes.row(buf.data(), r, d);
    }
#pragma omp barrier
    matmul(wgu, codes, m, gu_all, tid, team);
#pragma omp barrier
    for (int64_t r = rows.first; r < rows.last; ++r) {  // codes(silu(g) u)
      const uint16_t* gu = gu_all + r * 2 * inter;
      evospec_rows::silu_mul_row(gu, gu + inter, act + r * inter, inter);
      to_f32(act + r * inter, inter, buf.data());
      codes.row(buf.data(), r, inter);
    }
#pragma omp barrier
    matmul(wdown, codes, m, mlp, tid, team);
#pragma omp barrier
    for (int64_t r = rows.first; r < rows.last; ++r) {  // x2 = x1 + mlp, h2 = norm(x2) (the last layer: h1)
      const float* x1 = x1_all + r * d;
      for (int64_t i = 0; i < d; ++i) xo[r * d + i] = x1[i] + bf16_to_f32(mlp[r * d + i]);
      if (next)
        evospec_rows::norm_row(xo + r * d, next, ho + r * d, d, f_eps);
      else
        std::copy(h1_all + r * d, h1_all + (r + 1) * d, ho + r * d);
    }
  }
  return {x_out, h_out};
#endif
}

}  // namespace evospec_layer

// Llama decoder layers, and an EAGLE-2 draft step, run by one team of threads: llama_layer's
// calls without their dispatch (cpu_ops.cpp's llama_layer, llama_stack and draft_step ops).
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
//   | down tiles | x2 = x1 + mlp, h2 = norm(x2), codes(h2) for the next layer
//
// A stack runs its layers in one region (ping-pong x / h buffers between them); the draft step
// runs codes([embedding, feature]) | fc tiles | x = fc + bias, codes(x) before its one layer.
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
#include "team.h"
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
using evospec_team::row_pieces;
using evospec_team::share;
using evospec_team::Span;
using evospec_vnni::kGroup;
using evospec_vnni::kTile;

// A packed int4 weight [tiles, groups, 320]: its output width is tiles * 16, its input groups * 32;
// `stream`: read once a forward, prefetched non-temporally (vnni.h, prefetch_weight).
struct Weight {
  const uint8_t* data;
  int64_t tiles, groups;
  bool stream;
  Weight(const at::Tensor& w, bool stream)
      : data(w.data_ptr<uint8_t>()), tiles(w.size(0)), groups(w.size(1)), stream(stream) {}
  int64_t out() const { return tiles * kTile; }
  int64_t in() const { return groups * kGroup; }
};

bool packed_int4(const at::Tensor& w) {
  return w.scalar_type() == at::kByte && w.dim() == 3 && w.size(2) == evospec_int4::kBlock && w.is_contiguous();
}

bool norm_weight(const at::Tensor& w, int64_t d) {
  return w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == d && w.is_contiguous();
}

// The activation codes of a matmul input's rows, as evospec_vnni::quantize_rows makes them: each
// row read as float32 (bf16 rows converted into a thread's buffer first), then quantize_row.
struct Codes {
  int8_t* codes;
  float* scale;
  float* sum;
  void row(const float* x, int64_t r, int64_t k) const { groups(x, r, k, 0, k / kGroup); }
  // groups [g0, g1) of row r (x: those groups' k values, from column g0 * 32)
  void groups(const float* x, int64_t r, int64_t k, int64_t g0, int64_t g1) const {
    const int64_t at = r * (k / kGroup) + g0;
    evospec_vnni::quantize_row(x, (g1 - g0) * kGroup, codes + r * k + g0 * kGroup, scale + at, sum + at);
  }
};

inline void to_f32(const uint16_t* src, int64_t k, float* dst) {
  for (int64_t i = 0; i < k; ++i) dst[i] = bf16_to_f32(src[i]);
}

// Rows' products of one weight over the codes: thread tid's share of the output tiles.
void matmul(const Weight& w, const Codes& c, int64_t m, uint16_t* out, int tid, int team) {
  const Span s = share(w.tiles, tid, team);
  evospec_int4::tile_range(w.data, w.groups, s.first, s.last, c.codes, c.scale, c.sum, m, w.in(), out, w.out(),
                           w.stream);
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

bool tables_apply(const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  int64_t n) {
#ifndef EVOSPEC_VNNI
  return false;
#else
  const auto kt = k_cache.scalar_type();
  const int64_t dh = cos.size(-1);
  return cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
         sin.is_contiguous() && cos.numel() == n * dh && sin.numel() == n * dh && dh % 16 == 0 && dh <= 512 &&
         (kt == at::kHalf || kt == at::kFloat) && v_cache.scalar_type() == kt && k_cache.dim() == 5 &&
         k_cache.size(4) == dh && k_cache.stride(4) == 1 && v_cache.stride(4) == 1;
#endif
}

bool team_applies(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t n) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() && h.scalar_type() == at::kBFloat16 &&
         h.is_contiguous() && tables_apply(cos, sin, k_cache, v_cache, n);
}

#ifdef EVOSPEC_VNNI
namespace {

// One layer's weights: its four int4 products, the post-attention norm and the next layer's input
// norm (null: the stack's last layer, whose h is its post-attention one).
struct LayerWeights {
  Weight qkv, o, gate_up, down;
  const float* post;
  const float* next;
};

// One sequence of a stack_seqs_team forward: its own cache (batch 1), its length after the
// forward, and the attention plan a one-sequence step of that length makes (so its bits).
struct Seq {
  char *kbase, *vbase;  // layer 0 of its caches
  int64_t klayer, vlayer, end;
  evospec_attention::AttentionJobs att;
  int64_t first_job;  // its jobs' place in the forward's one list of attention jobs
};

// The forward's sizes and the caller's buffers (pointers: inside the parallel region a
// thread_local would name each thread's own).
struct Plan {
  int64_t m, n, d, dh, hq, hk, inter, kmax, end;
  float eps;
  bool half;
  const float *cos, *sin;
  char *kbase, *vbase;  // layer 0 of the caches
  int64_t klayer, vlayer;  // bytes from one layer to the next
  evospec_attention::AttentionJobs att;  // the plan, for layer 0's keys and values
  const std::vector<Seq>* seqs = nullptr;  // sequences in caches of their own (stack_seqs_team)
  Codes codes;
  uint16_t *qkv, *o, *gu, *act, *mlp, *h1;
  float *q, *attn, *x1;
  evospec_team::Barrier* bar;  // the region's (run_stack, stack_seqs_team, draft_team)
};

// Kept from call to call for decode-sized forwards; a prefill's (more than kKeepRows rows, where
// allocation is noise beside the compute) is freed after it, so a long prompt leaves no ~100 MB
// of buffers behind.
constexpr int64_t kKeepRows = 64;

struct Scratch {
  std::vector<int8_t> codes;
  std::vector<float> scale, sum, q, attn, x1, xs;
  std::vector<uint16_t> qkv, o, gu, act, mlp, h1, hs;
};

// Thread tid's share of the attention jobs of sequences in caches of their own, one list over
// all of them: each job runs on its sequence's plan, so a sequence gets its one-sequence bits.
void attend_seqs(const std::vector<Seq>& seqs, int64_t li, int tid, int team) {
  const Span jobs = share(seqs.back().first_job + seqs.back().att.jobs(), tid, team);
  for (const Seq& s : seqs) {
    const int64_t lo = std::max(jobs.first, s.first_job), hi = std::min(jobs.last, s.first_job + s.att.jobs());
    if (lo >= hi) continue;
    evospec_attention::AttentionJobs att = s.att;
    att.keys = s.kbase + li * s.klayer;
    att.values = s.vbase + li * s.vlayer;
    evospec_attention::run_attention_jobs(att, lo - s.first_job, hi - s.first_job);
  }
}

// Heads [h0, h1) of row r of a layer's qkv product (queries, then keys, then values): RoPE, and
// the keys' and values' rows into the cache (`buf`: 2 Dh floats of this thread).
void rope_heads(const Plan& p, const LayerWeights& w, int64_t li, int64_t r, int64_t h0, int64_t h1, float* buf) {
  const int64_t n = p.n, dh = p.dh, hq = p.hq, hk = p.hk;
  const int64_t bi = r / n, t = r % n;
  const Seq* sq = p.seqs ? &(*p.seqs)[bi] : nullptr;  // its own cache, position and RoPE row
  const int64_t slot = (sq ? sq->end : p.end) - n + t, tab = (sq ? r : t) * dh;
  const float *cr = p.cos + tab, *sr = p.sin + tab;
  char* kdst = sq ? sq->kbase + li * sq->klayer : p.kbase + li * p.klayer;
  char* vdst = sq ? sq->vbase + li * sq->vlayer : p.vbase + li * p.vlayer;
  const int64_t cb = sq ? 0 : bi;  // the batch entry in that cache
  float* kv = buf + dh;
  for (int64_t head = h0; head < h1; ++head) {
    const uint16_t* src = p.qkv + r * w.qkv.out() + head * dh;
    if (head < hq) {
      evospec_rows::rope_head(src, p.q + ((bi * hq + head) * n + t) * dh, cr, sr, dh, false, nullptr, 0.0f, buf);
      continue;
    }
    const bool value = head >= hq + hk;
    const int64_t g = value ? head - hq - hk : head - hq;
    evospec_rows::rope_head(src, kv, cr, sr, dh, value, nullptr, 0.0f, buf);
    const evospec_attention::AttentionJobs& pa = sq ? sq->att : p.att;
    const int64_t* st = value ? pa.vs : pa.ks;
    put(value ? vdst : kdst, p.half, cb * st[0] + g * st[1] + slot * st[2], kv, dh);
  }
}

// Column groups [g0, g1) of row r of the attention's output (heads side by side), rounded to
// bf16 as the o product takes them, into its activation codes (`part`: their floats).
void attention_codes(const Plan& p, int64_t r, int64_t g0, int64_t g1, float* part) {
  const int64_t n = p.n, dh = p.dh, hq = p.hq, bi = r / n, t = r % n, c0 = g0 * kGroup, c1 = g1 * kGroup;
  for (int64_t head = c0 / dh; head * dh < c1; ++head) {
    const float* src = p.attn + ((bi * hq + head) * n + t) * dh;
    const int64_t lo = std::max(c0, head * dh), hi = std::min(c1, (head + 1) * dh);
    for (int64_t c = lo; c < hi; ++c) part[c - c0] = bf16_to_f32(f32_to_bf16(src[c - head * dh]));
  }
  p.codes.groups(part, r, hq * dh, g0, g1);
}

// Layer `li`'s phases on thread tid, from (x, h) to (xo, ho); the codes of h are ready (the
// first phase of the stack, or the previous layer's last). With `codes_next`, the last phase
// also quantises ho for the layer after. The elementwise phases take rows in pieces (team.h):
// heads for RoPE, 32-wide column groups for the rest. `buf`: kmax + dh floats of this thread.
void layer_phases(const Plan& p, const LayerWeights& w, int64_t li, const float* x, float* xo, uint16_t* ho,
                  bool codes_next, int tid, int team, float* buf) {
  const int64_t m = p.m, d = p.d, dh = p.dh, hq = p.hq, hk = p.hk, inter = p.inter;
  const Span rows = share(m, tid, team);  // the norms' phases: whole rows (a norm reads its row)
  char* kb = p.kbase + li * p.klayer;
  char* vb = p.vbase + li * p.vlayer;
  matmul(w.qkv, p.codes, m, p.qkv, tid, team);
  p.bar->wait();
  row_pieces(m, hq + 2 * hk, tid, team,  // RoPE; K/V into the cache
             [&](int64_t r, int64_t h0, int64_t h1) { rope_heads(p, w, li, r, h0, h1, buf); });
  p.bar->wait();
  if (p.seqs) {
    attend_seqs(*p.seqs, li, tid, team);
  } else {
    evospec_attention::AttentionJobs att = p.att;
    att.keys = kb;
    att.values = vb;
    const Span jobs = share(att.jobs(), tid, team);
    evospec_attention::run_attention_jobs(att, jobs.first, jobs.last);
  }
  p.bar->wait();
  row_pieces(m, hq * dh / kGroup, tid, team, [&](int64_t r, int64_t g0, int64_t g1) {  // codes(bf16(attention))
    attention_codes(p, r, g0, g1, buf);
  });
  p.bar->wait();
  matmul(w.o, p.codes, m, p.o, tid, team);
  p.bar->wait();
  for (int64_t r = rows.first; r < rows.last; ++r) {  // x1 = x + o, h1 = norm(x1), codes(h1)
    float* x1 = p.x1 + r * d;
    for (int64_t i = 0; i < d; ++i) x1[i] = x[r * d + i] + bf16_to_f32(p.o[r * d + i]);
    evospec_rows::norm_row(x1, w.post, p.h1 + r * d, d, p.eps);
    to_f32(p.h1 + r * d, d, buf);
    p.codes.row(buf, r, d);
  }
  p.bar->wait();
  matmul(w.gate_up, p.codes, m, p.gu, tid, team);
  p.bar->wait();
  row_pieces(m, inter / kGroup, tid, team, [&](int64_t r, int64_t g0, int64_t g1) {  // codes(silu(g) u)
    const int64_t c0 = g0 * kGroup, c1 = g1 * kGroup;
    const uint16_t* gu = p.gu + r * 2 * inter;
    evospec_rows::silu_mul_row(gu + c0, gu + inter + c0, p.act + r * inter + c0, c1 - c0);
    to_f32(p.act + r * inter + c0, c1 - c0, buf);
    p.codes.groups(buf, r, inter, g0, g1);
  });
  p.bar->wait();
  matmul(w.down, p.codes, m, p.mlp, tid, team);
  p.bar->wait();
  for (int64_t r = rows.first; r < rows.last; ++r) {  // x2 = x1 + mlp, h2 = norm(x2) (the last layer: h1)
    const float* x1 = p.x1 + r * d;
    for (int64_t i = 0; i < d; ++i) xo[r * d + i] = x1[i] + bf16_to_f32(p.mlp[r * d + i]);
    if (!w.next) {
      std::copy(p.h1 + r * d, p.h1 + (r + 1) * d, ho + r * d);
      continue;
    }
    evospec_rows::norm_row(xo + r * d, w.next, ho + r * d, d, p.eps);
    if (codes_next) {
      to_f32(ho + r * d, d, buf);
      p.codes.row(buf, r, d);
    }
  }
  p.bar->wait();
}

}  // namespace

namespace {

// The checked weights of `layers` (`stream`: the target model's, read once a forward; a draft's
// are read again next round).
std::vector<LayerWeights> layer_weights(const std::vector<StackLayer>& layers, int64_t d, int64_t dh, int64_t hq,
                                        int64_t hk, bool stream) {
  TORCH_CHECK(!layers.empty(), "llama_layer: no layers");
  std::vector<LayerWeights> ws;
  for (const auto& l : layers) {
    for (const auto* w : {&l.qkv, &l.o, &l.gate_up, &l.down})
      TORCH_CHECK(packed_int4(*w), "llama_layer: weights must be contiguous uint8 [N/16, K/32, 320]");
    TORCH_CHECK(norm_weight(l.post, d) && (!l.next || norm_weight(*l.next, d)),
                "llama_layer: norm weights must be contiguous float32 [D]");
    ws.push_back({Weight(l.qkv, stream), Weight(l.o, stream), Weight(l.gate_up, stream), Weight(l.down, stream),
                  l.post.data_ptr<float>(),
                  l.next ? l.next->data_ptr<float>() : nullptr});
    const auto& w = ws.back();
    TORCH_CHECK(w.qkv.in() == d && w.qkv.out() == (hq + 2 * hk) * dh && w.o.in() == hq * dh && w.o.out() == d &&
                    w.gate_up.in() == d && w.down.in() == w.gate_up.out() / 2 && w.down.out() == d &&
                    w.gate_up.out() == ws.front().gate_up.out(),
                "llama_layer: weight shapes do not match the layer's sizes");
  }
  for (size_t i = 1; i < layers.size(); ++i)
    TORCH_CHECK(layers[i].layer == layers.front().layer + static_cast<int64_t>(i), "llama_layer: layers in order");
  return ws;
}

Plan make_plan(const std::vector<LayerWeights>& ws, int64_t first_layer, int64_t kin, const at::Tensor& cos,
               const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t end, int64_t b,
               int64_t n, int64_t d, int64_t hq, int64_t hk, double scale, double eps, int team_size,
               Scratch& sc) {
  Plan p;
  const int64_t m = b * n, dh = cos.size(-1);
  p.m = m, p.n = n, p.d = d, p.dh = dh, p.hq = hq, p.hk = hk, p.end = end;
  p.inter = ws.front().gate_up.out() / 2;
  p.kmax = std::max({kin, d, hq * dh, p.inter});
  p.eps = static_cast<float>(eps);
  p.half = k_cache.scalar_type() == at::kHalf;
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  const int64_t esize = p.half ? 2 : 4;
  p.kbase = static_cast<char*>(k_cache.data_ptr()) + first_layer * k_cache.stride(0) * esize;
  p.vbase = static_cast<char*>(v_cache.data_ptr()) + first_layer * v_cache.stride(0) * esize;
  p.klayer = k_cache.stride(0) * esize;
  p.vlayer = v_cache.stride(0) * esize;
  sc.codes.resize(m * p.kmax);
  sc.scale.resize(m * p.kmax / kGroup);
  sc.sum.resize(m * p.kmax / kGroup);
  sc.qkv.resize(m * (hq + 2 * hk) * dh);
  sc.o.resize(m * d);
  sc.gu.resize(m * 2 * p.inter);
  sc.act.resize(m * p.inter);
  sc.mlp.resize(m * d);
  sc.h1.resize(m * d);
  sc.q.resize(m * hq * dh);
  sc.attn.resize(m * hq * dh);
  sc.x1.resize(m * d);
  sc.xs.resize(2 * m * d);
  sc.hs.resize(2 * m * d);
  p.codes = {sc.codes.data(), sc.scale.data(), sc.sum.data()};
  p.qkv = sc.qkv.data(), p.o = sc.o.data(), p.gu = sc.gu.data(), p.act = sc.act.data();
  p.mlp = sc.mlp.data(), p.h1 = sc.h1.data();
  p.q = sc.q.data(), p.attn = sc.attn.data(), p.x1 = sc.x1.data();
  thread_local evospec_team::Barrier bar;  // the calling thread's regions, one at a time
  p.bar = &bar;
  p.att = evospec_attention::plan_attention(p.q, p.attn, k_cache.select(0, first_layer),
                                            v_cache.select(0, first_layer), hq, n, end, nullptr, false,
                                            static_cast<float>(scale), 0, team_size);
  return p;
}

// A row buffer of this thread (OpenMP threads persist, so it is kept from call to call).
float* row_buffer(int64_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(floats)) buf.resize(floats);
  return buf.data();
}

// The stack's parallel region: codes(h), then each layer from (x, h) to the next, ping-pong
// buffers between them, the last layer's into (x_out, h_out).
void run_stack(const Plan& p, const std::vector<LayerWeights>& ws, Scratch& sc, const at::Tensor& x,
               const at::Tensor& h, at::Tensor& x_out, at::Tensor& h_out, int team_size) {
  const int64_t m = p.m, d = p.d, dh = p.dh;
  float* xs = sc.xs.data();
  uint16_t* hs = sc.hs.data();
  const float* xp = x.data_ptr<float>();
  const auto* hp = reinterpret_cast<const uint16_t*>(h.data_ptr<at::BFloat16>());
  float* xo_last = x_out.data_ptr<float>();
  auto* ho_last = reinterpret_cast<uint16_t*>(h_out.data_ptr<at::BFloat16>());
  const int64_t count = static_cast<int64_t>(ws.size());

#pragma omp parallel num_threads(team_size)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp single
    p.bar->n = team;
    float* buf = row_buffer(p.kmax + dh);  // one row as float32, and a K/V head
    row_pieces(m, d / kGroup, tid, team, [&](int64_t r, int64_t g0, int64_t g1) {  // codes(h) of the first layer
      to_f32(hp + r * d + g0 * kGroup, (g1 - g0) * kGroup, buf);
      p.codes.groups(buf, r, d, g0, g1);
    });
    p.bar->wait();
    for (int64_t li = 0; li < count; ++li) {  // layer li: (x, h) -> (xo, ho), ping-pong buffers
      const bool last = li + 1 == count;
      const float* xin = li == 0 ? xp : xs + ((li - 1) % 2) * m * d;
      float* xo = last ? xo_last : xs + (li % 2) * m * d;
      uint16_t* ho = last ? ho_last : hs + (li % 2) * m * d;
      layer_phases(p, ws[li], li, xin, xo, ho, !last, tid, team, buf);
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> stack_team(const at::Tensor& x, const at::Tensor& h,
                                              const std::vector<StackLayer>& layers, const at::Tensor& cos,
                                              const at::Tensor& sin, const at::Tensor& k_cache,
                                              const at::Tensor& v_cache, int64_t end, int64_t b, int64_t n,
                                              int64_t hq, int64_t hk, double scale, double eps,
                                              const int64_t* tree) {
  const int64_t m = b * n, d = x.size(1), dh = cos.size(-1);
  const auto ws = layer_weights(layers, d, dh, hq, hk, true);
  const int team_size = at::get_num_threads();
  thread_local Scratch sc;
  Plan p = make_plan(ws, layers.front().layer, d, cos, sin, k_cache, v_cache, end, b, n, d, hq, hk, scale, eps,
                     team_size, sc);
  p.att.tree = tree;
  auto x_out = at::empty_like(x), h_out = at::empty_like(h);
  run_stack(p, ws, sc, x, h, x_out, h_out, team_size);
  if (m > kKeepRows) sc = Scratch{};
  return {x_out, h_out};
}

bool seqs_apply(const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                at::TensorList k_caches, at::TensorList v_caches) {
  const int64_t b = x.size(0);
  if (k_caches.empty() || !team_applies(x, h, cos.narrow(0, 0, 1), sin.narrow(0, 0, 1), k_caches[0], v_caches[0], 1))
    return false;
  if (cos.numel() != b * cos.size(-1) || sin.numel() != cos.numel()) return false;
  for (size_t i = 0; i < k_caches.size(); ++i)
    if (!tables_apply(cos.narrow(0, 0, 1), sin.narrow(0, 0, 1), k_caches[i], v_caches[i], 1) ||
        k_caches[i].scalar_type() != k_caches[0].scalar_type())
      return false;
  return true;
}

std::tuple<at::Tensor, at::Tensor> stack_seqs_team(const at::Tensor& x, const at::Tensor& h,
                                                   const std::vector<StackLayer>& layers, const at::Tensor& cos,
                                                   const at::Tensor& sin, at::TensorList k_caches,
                                                   at::TensorList v_caches, at::IntArrayRef ends, int64_t hq,
                                                   int64_t hk, double scale, double eps) {
  const int64_t b = x.size(0), d = x.size(1), dh = cos.size(-1);
  const auto ws = layer_weights(layers, d, dh, hq, hk, true);
  const int team_size = at::get_num_threads();
  const int64_t l0 = layers.front().layer;
  thread_local Scratch sc;
  thread_local std::vector<Seq> seqs;
  Plan p = make_plan(ws, l0, d, cos, sin, k_caches[0], v_caches[0], ends[0], b, 1, d, hq, hk, scale, eps, team_size,
                     sc);
  const int64_t esize = p.half ? 2 : 4;
  seqs.clear();
  int64_t first_job = 0;
  for (int64_t i = 0; i < b; ++i) {
    const at::Tensor &kc = k_caches[i], &vc = v_caches[i];
    Seq s;
    s.kbase = static_cast<char*>(kc.data_ptr()) + l0 * kc.stride(0) * esize;
    s.vbase = static_cast<char*>(vc.data_ptr()) + l0 * vc.stride(0) * esize;
    s.klayer = kc.stride(0) * esize;
    s.vlayer = vc.stride(0) * esize;
    s.end = ends[i];
    s.att = evospec_attention::plan_attention(p.q + i * hq * dh, p.attn + i * hq * dh, kc.select(0, l0),
                                              vc.select(0, l0), hq, 1, s.end, nullptr, false,
                                              static_cast<float>(scale), 0, team_size);
    s.first_job = first_job;
    first_job += s.att.jobs();
    seqs.push_back(s);
  }
  p.seqs = &seqs;
  auto x_out = at::empty_like(x), h_out = at::empty_like(h);
  run_stack(p, ws, sc, x, h, x_out, h_out, team_size);
  return {x_out, h_out};
}

at::Tensor draft_team(const at::Tensor& pairs, const at::Tensor& fc_w, const std::optional<at::Tensor>& fc_b,
                      const StackLayer& layer, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, int64_t end, int64_t b, int64_t n, int64_t hq, int64_t hk,
                      double scale, double eps) {
  TORCH_CHECK(pairs.scalar_type() == at::kFloat && pairs.dim() == 2 && pairs.is_contiguous() && pairs.size(0) == b * n,
              "draft_step: pairs must be contiguous float32 [B n, 2 D]");
  TORCH_CHECK(packed_int4(fc_w), "draft_step: fc must be contiguous uint8 [D/16, 2 D/32, 320]");
  const Weight fc(fc_w, false);
  const int64_t m = b * n, d = fc.out(), kin = pairs.size(1), dh = cos.size(-1);
  TORCH_CHECK(fc.in() == kin, "draft_step: fc takes ", fc.in(), " inputs, the pairs have ", kin);
  const bool bias = fc_b.has_value() && fc_b->defined();
  TORCH_CHECK(!bias || norm_weight(*fc_b, d), "draft_step: fc's bias must be contiguous float32 [D]");
  const auto ws = layer_weights({layer}, d, dh, hq, hk, false);
  TORCH_CHECK(!ws.front().next, "draft_step: the draft layer has no next norm");
  const int team_size = at::get_num_threads();
  thread_local Scratch sc;
  const Plan p = make_plan(ws, layer.layer, kin, cos, sin, k_cache, v_cache, end, b, n, d, hq, hk, scale, eps,
                           team_size, sc);
  float* x = sc.xs.data();  // fc's output [M, D], then the layer's input
  uint16_t* h_unused = sc.hs.data();
  auto out = at::empty({m, d}, pairs.options());
  const float* in = pairs.data_ptr<float>();
  const float* bp = bias ? fc_b->data_ptr<float>() : nullptr;
  float* xo = out.data_ptr<float>();

#pragma omp parallel num_threads(team_size)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
#pragma omp single
    p.bar->n = team;
    float* buf = row_buffer(p.kmax + dh);
    row_pieces(m, kin / kGroup, tid, team, [&](int64_t r, int64_t g0, int64_t g1) {  // codes([emb, feature])
      p.codes.groups(in + r * kin + g0 * kGroup, r, kin, g0, g1);
    });
    p.bar->wait();
    const Span tiles = share(fc.tiles, tid, team);
    evospec_int4::tile_range(fc.data, fc.groups, tiles.first, tiles.last, p.codes.codes, p.codes.scale, p.codes.sum,
                             m, kin, x, d, fc.stream);
    p.bar->wait();
    row_pieces(m, d / kGroup, tid, team, [&](int64_t r, int64_t g0, int64_t g1) {  // x = fc + bias, codes(x)
      float* xr = x + r * d;  // no input norm (EAGLE)
      if (bp)
        for (int64_t i = g0 * kGroup; i < g1 * kGroup; ++i) xr[i] += bp[i];
      p.codes.groups(xr + g0 * kGroup, r, d, g0, g1);
    });
    p.bar->wait();
    layer_phases(p, ws.front(), 0, x, xo, h_unused, false, tid, team, buf);
  }
  if (m > kKeepRows) sc = Scratch{};
  return out;
}

#else  // no VNNI or AVX2: tables_apply is false, so cpu_ops.cpp never calls these

std::tuple<at::Tensor, at::Tensor> stack_team(const at::Tensor&, const at::Tensor&, const std::vector<StackLayer>&,
                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                                              double, const int64_t*) {
  TORCH_CHECK(false, "stack_team needs the AVX2 or VNNI build of the op library");
}

bool seqs_apply(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                at::TensorList) {
  return false;
}

std::tuple<at::Tensor, at::Tensor> stack_seqs_team(const at::Tensor&, const at::Tensor&,
                                                   const std::vector<StackLayer>&, const at::Tensor&,
                                                   const at::Tensor&, at::TensorList, at::TensorList, at::IntArrayRef,
                                                   int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "llama_stack_seqs' team needs the AVX2 or VNNI build of the op library");
}

at::Tensor draft_team(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const StackLayer&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                      int64_t, int64_t, int64_t, double, double) {
  TORCH_CHECK(false, "draft_step needs the AVX2 or VNNI build of the op library");
}

#endif

}  // namespace evospec_layer

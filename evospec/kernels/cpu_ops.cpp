// Fused elementwise ops of a decoder layer on the CPU, registered as torch ops (evospec::*).
//
// Contract (see cpu_ops.py for the Python side and the torch reference of each op):
//   rms_norm_bf16(x f32 [..., D], w f32 [D], eps)            -> bf16 [..., D]
//   add_rms_norm_bf16(x f32 [..., D], y [..., D], w, eps)    -> (x + y f32, rms_norm(x + y) bf16)
//   rope_qkv(qkv bf16 [B, n, (Hq + 2 Hk) Dh], cos, sin f32 [n, Dh] or [B, n, Dh], Hq, Hk)
//                                                          -> q f32 [B, Hq, n, Dh], k, v [B, Hk, n, Dh]
//   silu_mul_bf16(gu bf16 [..., 2 I])                       -> silu(gu[:I]) * gu[I:] bf16 [..., I]
//   decode_attention(q f32 [B, H, n, Dh], keys, values f32 [B, Hk, S, Dh], mask?, scale)
//                                   -> softmax(scale q k^T) v f32 [B, H, n, Dh], row j over S - n + 1 + j keys
//   llama_layer(...): one decoder layer (a step, a row-exact chain, causal prefill rows): the
//                     calls above plus int4_matmul's, as fused.py's loop makes them
//
// Every op computes each row (the last dimension) with the same code whatever the number of
// rows, in float32, rounding once to bfloat16 (nearest-even) at the end: a row's result never
// depends on which batch it came in, which keeps chain verification equal to plain decoding.
// Built with -ffp-contract=off, so vector bodies and scalar tails round alike.

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <bit>
#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace {

using evospec_bf16::bf16_to_f32;
using evospec_bf16::f32_to_bf16;

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

constexpr int kLanes = 8;

// 1 / sqrt(mean(x^2) + eps) over one row, summed in kLanes fixed partial sums.
inline float inv_rms(const float* x, int64_t d, float eps) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += x[i + l] * x[i + l];
  for (int l = 0; i < d; ++i, ++l) acc[l] += x[i] * x[i];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  return 1.0f / std::sqrt(s / static_cast<float>(d) + eps);
}

// q . k over d floats, summed in kLanes fixed partial sums (vectorises without reordering).
inline float dot(const float* __restrict__ q, const float* __restrict__ k, int64_t d) {
  float acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += q[i + l] * k[i + l];
  for (int l = 0; i < d; ++i, ++l) acc[l] += q[i] * k[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// dot() of four query rows (`qs` floats apart) with one key, each row's sums exactly dot()'s;
// the four independent chains hide the adds' latency. d: a multiple of kLanes.
inline void dot4(const float* __restrict__ q, int64_t qs, const float* __restrict__ k, int64_t d, float* out) {
  float a0[kLanes] = {0}, a1[kLanes] = {0}, a2[kLanes] = {0}, a3[kLanes] = {0};
  for (int64_t i = 0; i < d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float kv = k[i + l];
      a0[l] += q[i + l] * kv;
      a1[l] += q[qs + i + l] * kv;
      a2[l] += q[2 * qs + i + l] * kv;
      a3[l] += q[3 * qs + i + l] * kv;
    }
  float* rows[4] = {a0, a1, a2, a3};
  for (int r = 0; r < 4; ++r) {
    const float* acc = rows[r];
    out[r] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  }
}

#if defined(__AVX__)
// dot() of one query with 8 keys (`ks` floats apart) at once, each sum exactly dot()'s: per
// key the kLanes partial sums over d, then ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)),
// done for the 8 keys together by a transposing add tree instead of one reduction per key.
// d: a multiple of kLanes (= 8, one __m256).
inline __m256 dot8(const float* __restrict__ q, const float* __restrict__ k, int64_t ks, int64_t d) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(qv, _mm256_loadu_ps(k + j * ks + i)));
  }
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7] (+ commutes exactly)
  const __m256 b01 = _mm256_hadd_ps(a[0], a[1]), b23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b45 = _mm256_hadd_ps(a[4], a[5]), b67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b01, b23);  // keys 0-3: (0+1)+(2+3) | (4+5)+(6+7)
  const __m256 c1 = _mm256_hadd_ps(b45, b67);  // keys 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// Scores scale * dot(q_r, k_t) of `nr` query rows (`dh` apart) for the keys t0 + 8 i < s0 that
// every row sees, written to score[r * stride + t]; masked keys (`mask`, or null) get -inf.
// Folds each row's maximum into best[r]; returns the first key it did not score.
inline int64_t score_blocks(const float* q, int64_t nr, const float* kb, int64_t ks, int64_t t0, int64_t s0,
                            const bool* mask, float scale, int64_t dh, float* score, int64_t stride,
                            float* best) {
  if (dh % kLanes) return t0;
  const __m256 sc = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
  int64_t t = t0;
  for (; t + 8 <= s0; t += 8) {
    __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    if (mask) {
      alignas(32) int32_t m8[8];
      for (int j = 0; j < 8; ++j) m8[j] = mask[t + j] ? -1 : 0;
      keep = _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(m8)));
    }
    for (int64_t r = 0; r < nr; ++r) {
      const __m256 sv = _mm256_blendv_ps(ninf, _mm256_mul_ps(sc, dot8(q + r * dh, kb + t * ks, ks, dh)), keep);
      _mm256_storeu_ps(score + r * stride + t, sv);
      alignas(32) float v[8];
      _mm256_store_ps(v, sv);
      for (int j = 0; j < 8; ++j) best[r] = v[j] > best[r] ? v[j] : best[r];
    }
  }
  return t;
}
#else
inline int64_t score_blocks(const float*, int64_t, const float*, int64_t, int64_t t0, int64_t, const bool*,
                            float, int64_t, float*, int64_t, float*) {
  return t0;
}
#endif

inline void norm_row(const float* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ out,
                     int64_t d, float eps) {
  float inv = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i) out[i] = f32_to_bf16(w[i] * (x[i] * inv));
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

std::tuple<at::Tensor, at::Tensor> add_rms_norm_bf16(const at::Tensor& x, const at::Tensor& y,
                                                     const at::Tensor& w, double eps) {
  check_rows(x, w, "add_rms_norm_bf16");
  TORCH_CHECK(y.sizes() == x.sizes(), "add_rms_norm_bf16: x and y differ in shape");
  auto yc = y.contiguous();
  TORCH_CHECK(yc.scalar_type() == at::kBFloat16 || yc.scalar_type() == at::kFloat,
              "add_rms_norm_bf16: y must be bfloat16 or float32");
  const bool y_bf16 = yc.scalar_type() == at::kBFloat16;
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto sum = at::empty_like(x);
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const void* yp = yc.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * d;
      float* sr = sp + r * d;
      if (y_bf16) {
        const uint16_t* yr = static_cast<const uint16_t*>(yp) + r * d;
        for (int64_t i = 0; i < d; ++i) sr[i] = xr[i] + bf16_to_f32(yr[i]);
      } else {
        const float* yr = static_cast<const float*>(yp) + r * d;
        for (int64_t i = 0; i < d; ++i) sr[i] = xr[i] + yr[i];
      }
      norm_row(sr, wp, op + r * d, d, static_cast<float>(eps));
    }
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t hq, int64_t hk) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 3, "rope_qkv: qkv must be bfloat16 [B, n, F]");
  const int64_t b = qkv.size(0), n = qkv.size(1);
  const int64_t dh = cos.size(-1), half = dh / 2;
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
        for (int64_t i = 0; i < dh; ++i) row[i] = bf16_to_f32(src[i]);
        if (h >= hq + hk) {
          for (int64_t i = 0; i < dh; ++i) dst[i] = row[i];
          continue;
        }
        for (int64_t i = 0; i < half; ++i) dst[i] = row[i] * cr[i] - row[i + half] * sr[i];
        for (int64_t i = half; i < dh; ++i) dst[i] = row[i] * cr[i] + row[i - half] * sr[i];
      }
    }
  });
  return {q, k, v};
}

// Kept out of line: inlined into silu_mul_bf16's loop, whose g and u point into one buffer, GCC 12
// dropped the restrict promise and left this loop scalar (6 ns an element instead of ~1).
__attribute__((noinline)) void silu_mul_row(const uint16_t* __restrict__ g, const uint16_t* __restrict__ u,
                                            uint16_t* __restrict__ o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float gv = bf16_to_f32(g[i]);
    o[i] = f32_to_bf16(gv / (1.0f + exp_f32(-gv)) * bf16_to_f32(u[i]));
  }
}

at::Tensor silu_mul_bf16(const at::Tensor& gu) {
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.size(-1) % 2 == 0, "silu_mul_bf16: gu must be bfloat16 [..., 2 I]");
  auto x = gu.contiguous();
  const int64_t width = x.size(-1), inter = width / 2, rows = x.numel() / width;
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const uint16_t* g = xp + r * width;
      const uint16_t* u = g + inter;
      uint16_t* o = op + r * inter;
      silu_mul_row(g, u, o, inter);
    }
  });
  return out;
}

// s[t] = exp(s[t] - m), and 0 where s[t] is -inf (a hidden key); branch-free so it vectorises.
void exp_shifted(float* __restrict__ s, int64_t n, float m) {
  for (int64_t t = 0; t < n; ++t) {
    const float x = s[t];
    const float e = exp_f32(x - m);
    s[t] = x == -INFINITY ? 0.0f : e;
  }
}

// kLanes floats as one value (GCC/Clang vector extension: SIMD where the target has it, plain
// loops elsewhere); each lane rounds as the scalar expression would (-ffp-contract=off).
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec splat(float x) { return Vec{} + x; }

constexpr int64_t kRowBlock = 4;
constexpr int64_t kChunk = 4 * kLanes;  // output elements summed together (four vectors)

// Attention of `nr` (<= kRowBlock) consecutive query rows of one head: row r (queries and
// outputs `dh` floats apart) sees the first s0 + r keys (rows `ks` / `vs` floats apart);
// `mask` (nr = 1 only, or null) hides keys. Per row, in float32: scores scale * dot(q, k) in key
// order, their max, e = exp(score - max) and their sum in key order, then the weighted sum of
// values, each element summed in key order from 0, and one division at the end. A row's bits
// depend only on its query and its keys, never on the other rows of the block: one-token
// steps (nr = 1) and a prefill's rows (blocks of 4) agree bitwise. The blocks load each key
// and value once for all their rows, and the weighted sums stay in registers. Keys before `t0`
// (a masked leading run: a batched row's left padding) are skipped: there they would add exact
// zeros to every sum, so the bits are those of the full loop.
void attend_block(const float* q, int64_t nr, const float* kb, int64_t ks, const float* vb, int64_t vs,
                  int64_t s0, const bool* mask, float scale, int64_t dh, float* score, int64_t stride,
                  float* out, int64_t t0 = 0) {
  float best[kRowBlock], total[kRowBlock];
  for (int64_t r = 0; r < nr; ++r) best[r] = -INFINITY, total[r] = 0.0f;
  const int64_t keys = s0 + nr - 1;
  for (int64_t t = score_blocks(q, nr, kb, ks, t0, s0, mask, scale, dh, score, stride, best); t < keys; ++t) {
    const float* kt = kb + t * ks;
    if (nr == kRowBlock && t < s0 && dh % kLanes == 0) {  // all four rows see key t
      float d4[kRowBlock];
      dot4(q, dh, kt, dh, d4);
      for (int64_t r = 0; r < kRowBlock; ++r) {
        const float sv = scale * d4[r];
        score[r * stride + t] = sv;
        best[r] = sv > best[r] ? sv : best[r];
      }
      continue;
    }
    for (int64_t r = t < s0 ? 0 : t - s0 + 1; r < nr; ++r) {
      const float sv = (mask && !mask[t]) ? -INFINITY : scale * dot(q + r * dh, kt, dh);
      score[r * stride + t] = sv;
      best[r] = sv > best[r] ? sv : best[r];
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    float* sr = score + r * stride;
    const int64_t n = s0 + r;
    const float m = best[r];
    exp_shifted(sr + t0, n - t0, m);
    float sum = 0.0f;
    for (int64_t t = t0; t < n; ++t) sum += sr[t];
    total[r] = sum;
  }
  if (nr == kRowBlock && dh % (2 * kLanes) == 0) {  // four rows: each value chunk loaded once
    for (int64_t i = 0; i < dh; i += 2 * kLanes) {
      Vec a[kRowBlock][2] = {};
      for (int64_t t = t0; t < s0 + kRowBlock - 1; ++t) {
        const Vec v0 = load(vb + t * vs + i), v1 = load(vb + t * vs + i + kLanes);
        for (int64_t r = t < s0 ? 0 : t - s0 + 1; r < kRowBlock; ++r) {
          const Vec w = splat(score[r * stride + t]);
          a[r][0] += w * v0;
          a[r][1] += w * v1;
        }
      }
      for (int64_t r = 0; r < kRowBlock; ++r) {
        const Vec vinv = splat(1.0f / total[r]);
        store(out + r * dh + i, a[r][0] * vinv);
        store(out + r * dh + i + kLanes, a[r][1] * vinv);
      }
    }
    return;
  }
  for (int64_t r = 0; r < nr; ++r) {
    const float* sr = score + r * stride;
    const int64_t n = s0 + r;
    const float inv = 1.0f / total[r];  // the weighted sum is normalised once, at the end
    float* o = out + r * dh;
    int64_t i = 0;
    for (; i + kChunk <= dh; i += kChunk) {  // four vectors of sums, held in registers
      Vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t t = t0; t < n; ++t) {
        const float* vt = vb + t * vs + i;
        const Vec w = splat(sr[t]);
        a0 += w * load(vt);
        a1 += w * load(vt + kLanes);
        a2 += w * load(vt + 2 * kLanes);
        a3 += w * load(vt + 3 * kLanes);
      }
      const Vec vinv = splat(inv);
      store(o + i, a0 * vinv);
      store(o + i + kLanes, a1 * vinv);
      store(o + i + 2 * kLanes, a2 * vinv);
      store(o + i + 3 * kLanes, a3 * vinv);
    }
    for (; i < dh; ++i) {
      float acc = 0.0f;
      for (int64_t t = t0; t < n; ++t) acc += sr[t] * vb[t * vs + i];
      o[i] = acc * inv;
    }
  }
}

// Query rows against S keys, row j of n seeing the first S - n + 1 + j of them (one-token
// steps: n = 1; a chain verified after the cache: each row sees the cache and the rows
// before it). q [B, H, n, Dh]; keys/values [B, Hk, S, Dh] (any strides but a contiguous last
// dim); mask (n = 1 only, optional) bool with S or B * S elements, True = attend. H is a
// multiple of Hk (GQA). Row j gives the bits a one-row call over its keys gives.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const std::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "decode_attention: q [B, H, n, Dh], keys/values [B, Hk, S, Dh]");
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), dh = q.size(3);
  const int64_t hk = keys.size(1), s = keys.size(2);
  TORCH_CHECK(keys.size(0) == b && keys.size(3) == dh && h % hk == 0 && dh <= 512 && n >= 1 && n <= s,
              "decode_attention: shapes of q and keys differ");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys need a contiguous last dim");
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
  auto qc = q.contiguous();
  auto out = at::empty({b, h, n, dh}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t group = h / hk;
  const float sc = static_cast<float>(scale);
  // Threads only where a row's work outweighs waking them (long contexts).
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, s * dh));
  if (n >= 2 * kRowBlock && !mp) {  // many causal rows (a prefill): blocks of rows per head
    const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
    at::parallel_for(0, b * h * blocks, std::max<int64_t>(1, grain / kRowBlock), [&](int64_t first, int64_t last) {
      std::vector<float> score(kRowBlock * s);
      for (int64_t blk = first; blk < last; ++blk) {  // blk = (bi * h + hi) * blocks + jb
        const int64_t bh = blk / blocks, j0 = (blk % blocks) * kRowBlock, bi = bh / h, kv = (bh % h) / group;
        const int64_t nr = std::min(kRowBlock, n - j0), row = bh * n + j0;
        attend_block(qp + row * dh, nr, kp + bi * ks0 + kv * ks1, ks2, vp + bi * vs0 + kv * vs1, vs2,
                     s - n + 1 + j0, nullptr, sc, dh, score.data(), s, op + row * dh);
      }
    });
    return out;
  }
  at::parallel_for(0, b * h * n, grain, [&](int64_t first, int64_t last) {
    std::vector<float> score(s);
    for (int64_t row = first; row < last; ++row) {  // row = (bi * h + hi) * n + j
      const int64_t bh = row / n, j = row % n, bi = bh / h, kv = (bh % h) / group;
      const bool* mr = mp ? mp + (per_batch ? bi * s : 0) : nullptr;
      const int64_t keys = s - n + 1 + j;
      int64_t t0 = 0;  // the masked leading run (left padding), if the row sees any key at all
      while (mr && t0 < keys && !mr[t0]) ++t0;
      attend_block(qp + row * dh, 1, kp + bi * ks0 + kv * ks1, ks2, vp + bi * vs0 + kv * vs1, vs2, keys,
                   mr, sc, dh, score.data(), s, op + row * dh, t0 < keys ? t0 : 0);
    }
  });
  return out;
}

at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& packed) {  // int4_matmul.cpp's op
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("evospec::int4_matmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(x, packed);
}

// One Llama-style decoder layer of a step, row-exact chain or causal prefill, with int4 (VNNI) linears: the
// calls fused.py's layer loop makes, in its order and on the same data, so its bits are that
// loop's; as one op, a recorded step replays one node per layer instead of ~38. x f32 / h bf16
// [M = B n, D]: the residual stream and its norm; with end = slots.size(0) (models/step.py's slot
// tensor: the cache length after this step), the layer's K/V go to slots [end - n, end) of
// `layer` in k_cache / v_cache [L, B, Hk, S, Dh], and row j attends to the first end - n + 1 + j.
// Returns (x, h) after the layer (h normed by next_w; the last layer, without it, returns x + mlp
// and the post-attention h).
std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& o_w,
    const at::Tensor& gate_up_w, const at::Tensor& down_w, const at::Tensor& post_w,
    const std::optional<at::Tensor>& next_w, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t layer, const at::Tensor& slots, int64_t b,
    int64_t n, int64_t hq, int64_t hk, double scale, double eps) {
  const int64_t end = slots.size(0);  // a tensor, not an int: a traced graph keeps its size symbolic
  TORCH_CHECK(x.dim() == 2 && x.size(0) == b * n && h.sizes() == x.sizes(), "llama_layer: x, h must be [B n, D]");
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && end >= n && end <= k_cache.size(3),
              "llama_layer: the cache cannot hold these slots");
  auto [q, k, v] = rope_qkv(int4_rows(h, qkv_w).view({b, n, -1}), cos, sin, hq, hk);
  auto keys = k_cache.select(0, layer), values = v_cache.select(0, layer);  // [B, Hk, S, Dh]
  keys.narrow(2, end - n, n).copy_(k);
  values.narrow(2, end - n, n).copy_(v);
  auto out = decode_attention(q, keys.narrow(2, 0, end), values.narrow(2, 0, end), std::nullopt, scale);
  out = out.transpose(1, 2).to(at::kBFloat16, false, false, at::MemoryFormat::Contiguous).view({b * n, -1});
  auto [x1, h1] = add_rms_norm_bf16(x, int4_rows(out, o_w), post_w, eps);
  auto mlp = int4_rows(silu_mul_bf16(int4_rows(h1, gate_up_w)), down_w);
  if (next_w.has_value() && next_w->defined()) return add_rms_norm_bf16(x1, mlp, *next_w, eps);
  return {x1 + mlp, h1};
}

}  // namespace

TORCH_LIBRARY(evospec, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm_bf16(Tensor x, Tensor y, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int hq, int hk) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul_bf16(Tensor gu) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale) -> Tensor");
  m.def("llama_layer(Tensor x, Tensor h, Tensor qkv_w, Tensor o_w, Tensor gate_up_w, Tensor down_w, "
        "Tensor post_w, Tensor? next_w, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int layer, Tensor slots, int b, int n, int hq, int hk, float scale, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16);
  m.impl("add_rms_norm_bf16", &add_rms_norm_bf16);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("decode_attention", &decode_attention);
  m.impl("llama_layer", &llama_layer);
}

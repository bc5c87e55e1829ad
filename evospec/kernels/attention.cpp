// Decode attention on the CPU: the arithmetic of the torch op evospec::decode_attention (attention_op.cpp).
//
// Contract (cpu_ops.py holds the torch reference, decode_attention_ref):
//   decode_attention(q f32 [B, H, n, Dh], keys, values f32 or f16 [B, Hk, S, Dh], mask?, scale,
//                    window = 0) -> softmax(scale q k^T) v, f32 [B, H, n, Dh]
// Row j of n sees the first S - n + 1 + j keys: n = 1 is a step; a chain verified after the
// cache has each row see the cache and the rows before it; a prefill's rows are causal. tree
// (int64 [n], n <= 64, no mask or window): the last n keys are a draft tree's nodes, parents
// before children, and row j sees the keys before them and the nodes i with bit i of tree[j] set
// (its ancestors and itself: bit j set, none above), as a one-token step sees those keys laid out
// behind the prefix: its total is summed over them so laid out (total_of), the same bits. mask
// (n = 1 only) hides keys (True = attend); window > 0 (a sliding-window layer) also hides a
// row's keys more than window - 1 behind its last one. H is a multiple of Hk (grouped
// queries). A head size that is not a multiple of 16 is padded with zeros (copies: tiny test
// models only).
//
// Per row, in float32, from its first visible key t0 (with a window: the window's first key
// rounded down to a multiple of 16, the keys before it hidden), products summed by explicit
// fused multiply-adds (one rounding each, std::fma where the CPU has none: the same bits
// everywhere; no other contraction, -ffp-contract=off):
//   score[t] = scale * dot(q, k_t): 16 lane sums over Dh (lane l takes d = l mod 16, in d
//              order), then one fixed tree over the lanes (lanes l and l + 8, then l + 4, ...)
//   m = max score; e[t] = exp(score[t] - m), 0 for a hidden key; total = the e's summed in 16
//   lanes (key t - t0 mod 16, in key order) and the same tree
//   out[d] = (sum over keys in order of e[t] * v_t[d], fused) * (1 / total)
// A hidden key adds exact zeros, so a row's bits depend only on its query, its visible keys and
// values and how many it sees: never on n, on the rows computed beside it (a block of rows
// shares loads -- each value's, and each key's or its f16 conversion -- and nothing else) or on
// the thread split; a left-padded row (a masked leading run) gives the bits of the same row
// without the padding. So one-token steps, verified chains and prefill rows agree bitwise,
// which keeps speculative decoding equal to plain decoding.
//
// Why: at a few hundred cached slots attention is a sixth of a SmolLM2 int4 step, and at a few
// thousand most of it. Scores are formed 16 keys at a time (one transposing add tree instead
// of a reduction per key), the query heads of one KV head share each key and value load, and
// an f16 cache halves the bytes a step streams. Without AVX-512 (16 ymm registers, not 32 zmm)
// the same sums are blocked smaller -- one key's sums for up to four rows at a time, pairs of
// rows' outputs -- or they spill on every multiply-add (12-24% off 2-4-row attention on a Zen 3,
// wave 29; 9-31% more since wave 31, when each key load began to serve up to four rows' scores
// and f16 keys and values to be converted as they are loaded, not shared through a buffer).
// With AVX-512 the same holds since wave 42: each key is loaded (converted) once for up to four
// rows whose queries stay in registers, where each row read a converted copy of the block before
// (attention of a 2-row verify 0.70-0.82x the time, a step's 0.81-0.96x; docs/benchmarks.md).

#include <ATen/Parallel.h>
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention.h"
#include "fastexp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace evospec_attention {
namespace {

using evospec_fastexp::exp_f32;

constexpr int kW = 16;         // lanes of a V (a zmm register where the CPU has AVX-512)
constexpr int kMaxRows = 16;   // query rows sharing each key and value load
constexpr int kGroup = 4;      // rows whose accumulators one value load feeds (registers)
constexpr int64_t kChunk = 64;  // keys per pass of the row groups: their values stay in L1

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// Without AVX-512 a V is two ymm registers, spelled out: GCC keeps a 64-byte vector type's halves
// on the stack around every intrinsic, which made this op 2-3x slower than the zmm build.
struct V {
  __m256 lo, hi;
};
inline V operator+(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V operator*(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V& operator+=(V& a, V b) { return a = a + b; }
// x > best ? x : best, lane by lane (MAXPS returns its second operand unless the first is greater)
inline V vmax(V x, V best) { return {_mm256_max_ps(x.lo, best.lo), _mm256_max_ps(x.hi, best.hi)}; }
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V load(const uint16_t* p) {  // 16 float16 -> float32 (exact)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store(float* p, V v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
// a * b + c rounded once (a fused multiply-add), lane by lane: the same bits on every CPU.
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

#define EVOSPEC_ATTENTION_YMM 1  // score_rows and weigh_groups below: blocked for 16 ymm registers
// An f16 cache's keys and values are converted as each group of rows loads them: converting a
// block once into a float32 buffer for all its rows to share costs an extra 256-bit store and
// reload per 8 lanes, which on a Zen 3 took more than the conversions it saved (2-row and
// longer blocks, 5-20% of the op; wave 31).

// Keys 8p..8p+7 of reduce16 after its first level, c[j] = lanes (l, l + 8) of key j added: the
// same tree (below) by in-lane shuffles.
inline __m256 reduce8_halves(const __m256* c) {
  __m256 e[4], f[2];
  for (int i = 0; i < 4; ++i)  // (l, l + 4): keys 2i | 2i + 1, four lanes each
    e[i] = _mm256_add_ps(_mm256_permute2f128_ps(c[2 * i], c[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(c[2 * i], c[2 * i + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // (l, l + 2): keys 4m, 4m + 2 | 4m + 1, 4m + 3, two lanes each
    f[m] = _mm256_add_ps(_mm256_shuffle_ps(e[2 * m], e[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(e[2 * m], e[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // (0, 1): keys 0, 2, 4, 6 | 1, 3, 5, 7, then into key order
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline __m256 halves(V a) { return _mm256_add_ps(a.lo, a.hi); }  // (l, l + 8)
#else
typedef float V __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t VI __attribute__((vector_size(kW * sizeof(int32_t))));

#if defined(__clang__)
#define EVOSPEC_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define EVOSPEC_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, VI{__VA_ARGS__})
#endif

inline V vmax(V x, V best) { return x > best ? x : best; }

inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline V load(const uint16_t* p) {  // 16 float16 -> float32 (exact)
#if defined(__AVX512F__)
  const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 x[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
#else
  float x[kW];
  for (int l = 0; l < kW; ++l) x[l] = static_cast<float>(c10::Half(p[l], c10::Half::from_bits()));
#endif
  V v;
  std::memcpy(&v, &x, sizeof v);
  return v;
}

inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
inline V splat(float x) { return V{} + x; }

// a * b + c rounded once (a fused multiply-add), lane by lane: the same bits on every CPU.
inline V fma(V a, V b, V c) {
#if defined(__AVX512F__)
  __m512 x, y, z;
  std::memcpy(&x, &a, sizeof a), std::memcpy(&y, &b, sizeof b), std::memcpy(&z, &c, sizeof c);
  const __m512 r = _mm512_fmadd_ps(x, y, z);
#elif defined(__FMA__)
  __m256 x[2], y[2], z[2];
  std::memcpy(x, &a, sizeof a), std::memcpy(y, &b, sizeof b), std::memcpy(z, &c, sizeof c);
  const __m256 r[2] = {_mm256_fmadd_ps(x[0], y[0], z[0]), _mm256_fmadd_ps(x[1], y[1], z[1])};
#else
  float r[kW];
  for (int l = 0; l < kW; ++l) r[l] = std::fma(a[l], b[l], c[l]);
#endif
  V v;
  std::memcpy(&v, &r, sizeof v);
  return v;
}


// Lane j: the sum of a[j]'s 16 lanes by the tree (l, l + 8), (l, l + 4), (l, l + 2), (0, 1),
// formed for the 16 vectors at once by shuffles and adds: each key's sum is the same bits
// wherever in a block it sits.
inline V reduce16(const V* a) {
  V c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: key 2i, 8-15: key 2i + 1
    c[i] = EVOSPEC_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           EVOSPEC_SHUFFLE(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // four lanes per key
    e[i] = EVOSPEC_SHUFFLE(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           EVOSPEC_SHUFFLE(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // two lanes per key
    f[i] = EVOSPEC_SHUFFLE(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           EVOSPEC_SHUFFLE(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return EVOSPEC_SHUFFLE(f[0], f[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         EVOSPEC_SHUFFLE(f[0], f[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#endif

inline float sum16(V x) {  // reduce16's tree for one vector
  float a[kW];
  std::memcpy(a, &x, sizeof a);
  for (int l = 0; l < 8; ++l) a[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) a[l] = a[l] + a[l + 4];
  for (int l = 0; l < 2; ++l) a[l] = a[l] + a[l + 2];
  return a[0] + a[1];
}

inline float max16(V x) {  // exact in any order
  float a[kW];
  std::memcpy(a, &x, sizeof a);
  float m = a[0];
  for (int l = 1; l < kW; ++l) m = a[l] > m ? a[l] : m;
  return m;
}

// The rows one call of attend() computes: query heads of one KV head (and chain rows), each
// seeing keys [t0, keys).
struct Rows {
  const float* q[kMaxRows];
  float* out[kMaxRows];
  int64_t keys[kMaxRows];
  int64_t lo[kMaxRows];  // its first visible key (a window's), hidden before it; 0 without one
  uint64_t tree[kMaxRows];  // a tree's rows: the nodes it sees (bit i: node i, key tree_first + i)
  int64_t tree_first = -1;  // the first tree node's key; -1: no tree (every key up to its own seen)
  int nr;
};

#ifdef EVOSPEC_ATTENTION_YMM
// score_rows for rows [r0, r0 + NR): each key's 16-lane chunks are loaded (an f16 key's
// converted) once for the NR rows, whose lane sums fill 2 NR ymm. The same products and sums,
// in the same order, as one row at a time: lane l of row r and key j is q_r[l] k_j[l], then
// fused multiply-adds in d order; (l, l + 8) halves; reduce8_halves over 8 keys.
template <int NR, typename K>
void score_group(const Rows& rows, int r0, const K* const* kp, int64_t tb, int64_t t0, int64_t dh, V scale,
                 float* score, int64_t stride) {
  __m256 c[NR][kW];
  for (int j = 0; j < kW; ++j) {
    V a[NR];
    const V k0 = load(kp[j]);
    for (int r = 0; r < NR; ++r) a[r] = load(rows.q[r0 + r]) * k0;
    for (int64_t d = kW; d < dh; d += kW) {
      const V kd = load(kp[j] + d);
      for (int r = 0; r < NR; ++r) a[r] = fma(load(rows.q[r0 + r] + d), kd, a[r]);
    }
    for (int r = 0; r < NR; ++r) c[r][j] = halves(a[r]);
  }
  for (int r = 0; r < NR; ++r) {
    const V sums = {reduce8_halves(c[r]), reduce8_halves(c[r] + 8)};
    store(score + (r0 + r) * stride + (tb - t0), scale * sums);
  }
}

constexpr int kKeyRows = 4;  // rows sharing each key load: 8 ymm of lane sums, 2 of the key

// score[r][t - t0] = scale * dot(q_r, k_t) for the 16 keys kp[j] = k_{tb + j}, up to kKeyRows
// rows sharing each key's loads (and an f16 key's conversion).
template <typename K>
void score_rows(const Rows& rows, const K* const* kp, int64_t tb, int64_t t0, int64_t dh, V scale, float* score,
                int64_t stride) {
  for (int r0 = 0; r0 < rows.nr; r0 += kKeyRows) {
    switch (std::min(kKeyRows, rows.nr - r0)) {
      case 1: score_group<1>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      case 2: score_group<2>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      case 3: score_group<3>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      default: score_group<4>(rows, r0, kp, tb, t0, dh, scale, score, stride);
    }
  }
}
#else
// score_rows for rows [r0, r0 + NR): each key's 16-lane chunks are loaded (an f16 key's
// converted) once for the NR rows, whose queries stay in registers where the head is DC chunks
// (DC = 0: any head size, the query chunks loaded as they are used). The same products and sums,
// in the same order, as one row at a time: lane l of row r and key j is q_r[l] k_j[l], then
// fused multiply-adds in d order; reduce16's tree over each row's 16 keys.
template <int NR, int DC, typename K>
void score_group(const Rows& rows, int r0, const K* const* kp, int64_t tb, int64_t t0, int64_t dh, V scale,
                 float* score, int64_t stride) {
  const int64_t chunks = DC > 0 ? DC : dh / kW;
  V qv[NR][DC > 0 ? DC : 1];
  if constexpr (DC > 0)
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < DC; ++c) qv[r][c] = load(rows.q[r0 + r] + c * kW);
  const auto q = [&](int r, int64_t c) -> V {
    if constexpr (DC > 0) return qv[r][c];
    return load(rows.q[r0 + r] + c * kW);
  };
  V sums[NR][kW];  // lane sums per row and key
  for (int j = 0; j < kW; ++j) {
    V a[NR];
    const V k0 = load(kp[j]);
    for (int r = 0; r < NR; ++r) a[r] = q(r, 0) * k0;
    for (int64_t c = 1; c < chunks; ++c) {
      const V kc = load(kp[j] + c * kW);
      for (int r = 0; r < NR; ++r) a[r] = fma(q(r, c), kc, a[r]);
    }
    for (int r = 0; r < NR; ++r) sums[r][j] = a[r];
  }
  for (int r = 0; r < NR; ++r) store(score + (r0 + r) * stride + (tb - t0), scale * reduce16(sums[r]));
}

constexpr int kKeyRows = 4;  // rows sharing each key load: their queries (a 64-wide head) in 16 zmm

template <int DC, typename K>
void score_groups(const Rows& rows, const K* const* kp, int64_t tb, int64_t t0, int64_t dh, V scale, float* score,
                  int64_t stride) {
  for (int r0 = 0; r0 < rows.nr; r0 += kKeyRows) {
    switch (std::min(kKeyRows, rows.nr - r0)) {
      case 1: score_group<1, DC>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      case 2: score_group<2, DC>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      case 3: score_group<3, DC>(rows, r0, kp, tb, t0, dh, scale, score, stride); break;
      default: score_group<4, DC>(rows, r0, kp, tb, t0, dh, scale, score, stride);
    }
  }
}

// score[r][t - t0] = scale * dot(q_r, k_t) for the 16 keys kp[j] = k_{tb + j}, up to kKeyRows
// rows sharing each key's loads (and an f16 key's conversion).
template <typename K>
void score_rows(const Rows& rows, const K* const* kp, int64_t tb, int64_t t0, int64_t dh, V scale, float* score,
                int64_t stride) {
  if (dh == 4 * kW)
    score_groups<4>(rows, kp, tb, t0, dh, scale, score, stride);
  else
    score_groups<0>(rows, kp, tb, t0, dh, scale, score, stride);
}
#endif

// Prefetch rows [from, to) of a key or value head (`stride` elements apart, dh each) into L1:
// g_kv_ahead keys ahead of the ones a loop is at. The hardware prefetchers stop at each 4 KB
// page; at 1,000 cached slots a step's keys and values are ~23 MB, read between the weights'
// streams, and prefetching 64 keys ahead made a one-token step ~7% shorter on the Xeon VM of
// docs/benchmarks.md, wave 46 (~1% at 300 slots; nothing to prefetch at short context).
template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t from, int64_t to, int64_t dh) {
  if (g_kv_ahead <= 0) return;
  const int64_t bytes = dh * static_cast<int64_t>(sizeof(T));
  for (int64_t t = from; t < to; ++t) {
    const char* p = reinterpret_cast<const char*>(base + t * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
}

// score_rows for the 16 keys from tb (keys past `end`: zeros), read from the cache as they lie
// (an f16 key converted by each group of rows that loads it).
template <typename T>
void score_block(const Rows& rows, const T* kb, int64_t ks, int64_t tb, int64_t end, int64_t t0, int64_t dh,
                 V scale, float* score, int64_t stride, const T* zeros) {
  const T* kp[kW];
  for (int j = 0; j < kW; ++j) kp[j] = tb + j < end ? kb + (tb + j) * ks : zeros;
  prefetch_rows(kb, ks, tb + g_kv_ahead, std::min(end, tb + kW + g_kv_ahead), dh);
  score_rows(rows, kp, tb, t0, dh, scale, score, stride);
}

// s[i] = exp(s[i] - m), and 0 where s[i] is -inf (a hidden key); branch-free so it vectorises.
void exp_shifted(float* __restrict__ s, int64_t n, float m) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = s[i];
    const float e = exp_f32(x - m);
    s[i] = x == -INFINITY ? 0.0f : e;
  }
}

// The sum of e[0, count) in 16 lanes (e[i] in lane i mod 16, in order) and the fixed tree over
// the lanes. With a tree (tree_first >= 0), the e's of the tree keys the row does not see are left
// out and the rest moved down behind the prefix, as a one-token step lays out its keys: the same
// lanes, so the same bits as that step's total.
float total_of(const float* e, int64_t count, int64_t t0, int64_t tree_first, uint64_t seen) {
  V total = {};
  if (tree_first < 0) {
    for (int64_t i = 0; i < count; i += kW) total += load(e + i);
    return sum16(total);
  }
  const int64_t base = tree_first - t0, whole = base / kW * kW;  // keys before the tree; their whole blocks
  for (int64_t i = 0; i < whole; i += kW) total += load(e + i);
  float tail[2 * kW + 64];  // the last prefix block's keys, then the <= 64 tree keys seen, padded
  int64_t w = 0;
  for (int64_t i = whole; i < base; ++i) tail[w++] = e[i];
  for (int64_t i = base; i < count; ++i)
    if (i - base < 64 && ((seen >> (i - base)) & 1)) tail[w++] = e[i];
  for (; w % kW; ++w) tail[w] = 0.0f;
  for (int64_t i = 0; i < w; i += kW) total += load(tail + i);
  return sum16(total);
}

// Row r's scores -> its e's (in place, 0 before `lo`, for a tree's nodes it does not see and past
// its keys up to a whole block); returns 1 / total.
float softmax_row(float* s, int64_t count, int64_t t0, int64_t lo, const bool* mask, int64_t tree_first,
                  uint64_t seen) {
  const int64_t padded = (count + kW - 1) / kW * kW;
  if (mask)
    for (int64_t i = 0; i < count; ++i) s[i] = mask[t0 + i] ? s[i] : -INFINITY;
  for (int64_t i = 0; i < lo - t0 && i < count; ++i) s[i] = -INFINITY;
  if (tree_first >= 0)
    for (int64_t i = tree_first - t0; i < count; ++i)
      if (!((seen >> (i - (tree_first - t0))) & 1)) s[i] = -INFINITY;
  for (int64_t i = count; i < padded; ++i) s[i] = -INFINITY;
  V best = splat(-INFINITY);
  for (int64_t i = 0; i < padded; i += kW) {
    const V x = load(s + i);
    best = vmax(x, best);
  }
  exp_shifted(s, padded, max16(best));
  return 1.0f / total_of(s, padded, t0, tree_first, seen);
}

// out_r += sum over keys [ta, te) of e_r[t] v_t for the rows [r0, r0 + NR), CW vectors of each
// value row at a time (va: key ta's value, each next key's `vs` elements on). out holds the
// running sums between calls: a float32 store and load are exact, so a row's sum is the one
// fused chain over its keys in order whatever the chunking and grouping.
template <typename T, int NR, int CW>
void weigh(const Rows& rows, int r0, const T* va, int64_t vs, int64_t t0, int64_t ta, int64_t te, int64_t dh,
           const float* score, int64_t stride) {
  for (int64_t i = 0; i < dh; i += CW * kW) {
    V acc[NR][CW];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < CW; ++c) acc[r][c] = load(rows.out[r0 + r] + i + c * kW);
    for (int64_t t = ta; t < te; ++t) {
      V v[CW];
      for (int c = 0; c < CW; ++c) v[c] = load(va + (t - ta) * vs + i + c * kW);
      for (int r = 0; r < NR; ++r) {
        if (t >= rows.keys[r0 + r]) continue;
        const V w = splat(score[(r0 + r) * stride + (t - t0)]);
        for (int c = 0; c < CW; ++c) acc[r][c] = fma(w, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < CW; ++c) store(rows.out[r0 + r] + i + c * kW, acc[r][c]);
  }
}

template <typename T, int CW>
void weigh_group(const Rows& rows, int r0, int nr, const T* vb, int64_t vs, int64_t t0, int64_t ta, int64_t te,
                 int64_t dh, const float* score, int64_t stride) {
  switch (nr) {
    case 1: return weigh<T, 1, CW>(rows, r0, vb, vs, t0, ta, te, dh, score, stride);
    case 2: return weigh<T, 2, CW>(rows, r0, vb, vs, t0, ta, te, dh, score, stride);
    case 3: return weigh<T, 3, CW>(rows, r0, vb, vs, t0, ta, te, dh, score, stride);
    default: return weigh<T, 4, CW>(rows, r0, vb, vs, t0, ta, te, dh, score, stride);
  }
}

#ifdef EVOSPEC_ATTENTION_YMM
// One chunk's weighing for ymm registers: a value's 16 lanes are two ymm, and each sum is one
// chain of dependent multiply-adds, so a group of rows must hold enough sums to hide their
// latency and few enough to stay in the 16 registers beside the value vectors: pairs of rows
// over 32 lanes (8 ymm of sums), a lone row over 64.
template <typename T>
void weigh_groups(const Rows& rows, const T* va, int64_t vs, int64_t t0, int64_t ta, int64_t te, int64_t dh,
                  const float* score, int64_t stride) {
  for (int r0 = 0; r0 < rows.nr; r0 += 2) {
    if (rows.nr - r0 >= 2) {
      if (dh % (2 * kW) == 0) weigh<T, 2, 2>(rows, r0, va, vs, t0, ta, te, dh, score, stride);
      else weigh<T, 2, 1>(rows, r0, va, vs, t0, ta, te, dh, score, stride);
    } else if (dh % (4 * kW) == 0) {
      weigh<T, 1, 4>(rows, r0, va, vs, t0, ta, te, dh, score, stride);
    } else if (dh % (2 * kW) == 0) {
      weigh<T, 1, 2>(rows, r0, va, vs, t0, ta, te, dh, score, stride);
    } else {
      weigh<T, 1, 1>(rows, r0, va, vs, t0, ta, te, dh, score, stride);
    }
  }
}
#else
// One chunk's weighing: groups of kGroup rows, each value row CW vectors at a time.
template <typename T>
void weigh_groups(const Rows& rows, const T* va, int64_t vs, int64_t t0, int64_t ta, int64_t te, int64_t dh,
                  const float* score, int64_t stride) {
  for (int r0 = 0; r0 < rows.nr; r0 += kGroup) {
    const int nr = std::min(kGroup, rows.nr - r0);
    if (dh % (4 * kW) == 0) weigh_group<T, 4>(rows, r0, nr, va, vs, t0, ta, te, dh, score, stride);
    else if (dh % (2 * kW) == 0) weigh_group<T, 2>(rows, r0, nr, va, vs, t0, ta, te, dh, score, stride);
    else weigh_group<T, 1>(rows, r0, nr, va, vs, t0, ta, te, dh, score, stride);
  }
}
#endif

// out_r = (sum_t e_r[t] v_t) * inv_r: keys in chunks of kChunk, each chunk's values read by every
// group of rows while they sit in L1 (a block of up to kMaxRows rows reads the values once; an
// f16 chunk is converted by each group as it loads it).
template <typename T>
void weigh_rows(const Rows& rows, const T* vb, int64_t vs, int64_t t0, int64_t end, int64_t dh,
                const float* score, int64_t stride, const float* inv) {
  for (int r = 0; r < rows.nr; ++r) std::memset(rows.out[r], 0, dh * sizeof(float));
  for (int64_t ta = t0; ta < end; ta += kChunk) {
    const int64_t te = std::min(end, ta + kChunk);
    prefetch_rows(vb, vs, ta + g_kv_ahead, std::min(end, te + g_kv_ahead), dh);
    weigh_groups<T>(rows, vb + ta * vs, vs, t0, ta, te, dh, score, stride);
  }
  for (int r = 0; r < rows.nr; ++r)
    for (int64_t i = 0; i < dh; i += kW) store(rows.out[r] + i, load(rows.out[r] + i) * splat(inv[r]));
}

// Attention of `rows` over one KV head's keys kb / values vb (rows `ks` / `vs` apart) from t0.
template <typename T>
void attend(const Rows& rows, const T* kb, int64_t ks, const T* vb, int64_t vs, int64_t t0, const bool* mask,
            float scale, int64_t dh, float* score, int64_t stride, const T* zeros) {
  int64_t end = 0;
  for (int r = 0; r < rows.nr; ++r) end = std::max(end, rows.keys[r]);
  const V sc = splat(scale);
  for (int64_t tb = t0; tb < end; tb += kW)
    score_block(rows, kb, ks, tb, end, t0, dh, sc, score, stride, zeros);
  float inv[kMaxRows];
  for (int r = 0; r < rows.nr; ++r)
    inv[r] = softmax_row(score + r * stride, rows.keys[r] - t0, t0, rows.lo[r], mask, rows.tree_first,
                         rows.tree[r]);
  weigh_rows<T>(rows, vb, vs, t0, end, dh, score, stride, inv);
}

// One job: the rows of block `job` (batch row, KV head, row block) over that head's keys.
template <typename T>
void run_job(const AttentionJobs& a, int64_t job, float* score, const T* zeros) {
  const T* kp = static_cast<const T*>(a.keys);
  const T* vp = static_cast<const T*>(a.values);
  const int64_t group = a.h / a.hk, per_kv = group * a.n;
  const int64_t bi = job / (a.hk * a.blocks), kv = job / a.blocks % a.hk, r0 = job % a.blocks * a.rb;
  Rows rows;
  rows.nr = static_cast<int>(std::min(a.rb, per_kv - r0));
  for (int i = 0; i < rows.nr; ++i) {
    const int64_t j = (r0 + i) / group, head = kv * group + (r0 + i) % group;
    const int64_t row = (bi * a.h + head) * a.n + j;
    rows.q[i] = a.q + row * a.dh;
    rows.out[i] = a.out + row * a.dh;
    rows.keys[i] = a.s - a.n + 1 + j;
    rows.lo[i] = a.window > 0 ? std::max<int64_t>(0, rows.keys[i] - a.window) : 0;
    rows.tree[i] = a.tree ? static_cast<uint64_t>(a.tree[j]) : 0;
  }
  rows.tree_first = a.tree ? a.s - a.n : -1;
  const bool* mr = a.mask ? a.mask + (a.per_batch ? bi * a.s : 0) : nullptr;
  int64_t t0 = 0;  // a masked leading run (left padding) is skipped, if the row sees any key
  while (mr && t0 < a.s && !mr[t0]) ++t0;
  if (t0 == a.s) t0 = 0;
  if (a.window > 0) {  // from the block of 16 holding the earliest window start: a lone row's lanes
    int64_t lo = rows.lo[0];
    for (int i = 1; i < rows.nr; ++i) lo = std::min(lo, rows.lo[i]);
    t0 = std::max(t0, lo / kW * kW);
  }
  attend<T>(rows, kp + bi * a.ks[0] + kv * a.ks[1], a.ks[2], vp + bi * a.vs[0] + kv * a.vs[1], a.vs[2], t0, mr,
            a.scale, a.dh, score, a.stride, zeros);
}

template <typename T>
void run_jobs(const AttentionJobs& a, int64_t first, int64_t last) {
  // Per-thread scratch kept across calls (a step calls this once per layer): scores are written
  // before they are read; the zero key (past a block's last) only ever grows, with zeros.
  thread_local std::vector<float> score;
  thread_local std::vector<T> zeros;  // +0 in either format
  if (score.size() < static_cast<size_t>(a.rb * a.stride)) score.resize(a.rb * a.stride);
  if (zeros.size() < static_cast<size_t>(a.dh)) zeros.resize(a.dh, T{0});
  for (int64_t job = first; job < last; ++job) run_job<T>(a, job, score.data(), zeros.data());
}

}  // namespace

AttentionJobs plan_attention(const float* q, float* out, const at::Tensor& keys, const at::Tensor& values, int64_t h,
                             int64_t n, int64_t s, const bool* mask, bool per_batch, float scale, int64_t window,
                             int threads) {
  AttentionJobs a;
  a.q = q, a.out = out, a.keys = keys.data_ptr(), a.values = values.data_ptr();
  a.half = keys.scalar_type() == at::kHalf;
  a.mask = mask, a.per_batch = per_batch;
  a.b = keys.size(0), a.h = h, a.n = n, a.dh = keys.size(3), a.hk = keys.size(1), a.s = s;
  for (int d = 0; d < 3; ++d) a.ks[d] = keys.stride(d), a.vs[d] = values.stride(d);
  a.scale = scale, a.window = window;
  // A KV head's rows (query head g of its group, chain row j) in blocks of up to kMaxRows,
  // r = j * group + g; smaller blocks where there would be too few to keep the threads busy.
  // Blocks of even sizes: 9 rows as 5 + 4, not 8 + 1.
  const int64_t per_kv = a.h / a.hk * a.n;
  int64_t blocks = (per_kv + kMaxRows - 1) / kMaxRows;
  while (blocks < per_kv && a.b * a.hk * blocks < 2 * threads) ++blocks;
  a.rb = (per_kv + blocks - 1) / blocks;
  a.blocks = (per_kv + a.rb - 1) / a.rb;
  a.stride = (a.s + kW - 1) / kW * kW;
  // Threads only where a block's work outweighs waking them (long contexts).
  a.grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(1, a.rb * a.s * a.dh));
  return a;
}

void run_attention_jobs(const AttentionJobs& a, int64_t first, int64_t last) {
  if (a.half)
    run_jobs<uint16_t>(a, first, last);
  else
    run_jobs<float>(a, first, last);
}

}  // namespace evospec_attention

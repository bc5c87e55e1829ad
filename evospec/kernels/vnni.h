// Activation codes for the int8-activation matmuls (int4_matmul.cpp, int8_matmul.cpp): one quantiser
// for both, and the 16-lane integer and float vectors their tile loops are written in.
//
// Each row's group of 32 inputs becomes int8 codes by its own scale a = max|x| / 127 (rounded
// to nearest even, so |code| <= 127), as llama.cpp's Q8_0; with the scale go the group's code
// sum (for the weights' offsets) and the codes themselves. A row's codes depend on that row only.
//
// Three instruction sets run the same arithmetic, so every build gives the same bits (integer
// dot products are exact; the float epilogues are the same multiplies and adds in the same
// order, -ffp-contract=off):
//   avx512-vnni  one zmm per 16 lanes, VPDPBUSD (4 u8 x s8 products summed into each int32 lane);
//   avx-vnni     two ymm halves, the VEX-encoded VPDPBUSD (Alder Lake and later laptop cores);
//   avx2         two ymm halves, VPMADDUBSW + VPMADDWD in place of VPDPBUSD (exact here: the
//                int4 weights' products and the int8 weights' sign-folded ones cannot saturate
//                16 bits, see group_dots_u4 and dot4_u8).
// EVOSPEC_VNNI names the build that has one of them (the kernels' historical name); kIsa which.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define EVOSPEC_VNNI 1
#define EVOSPEC_ZMM 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EVOSPEC_VNNI 1
#endif

#ifdef EVOSPEC_VNNI

#include <ATen/ATen.h>
#include <immintrin.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace evospec_vnni {

constexpr int64_t kGroup = 32;  // input columns per activation scale (and per int4 weight group)
constexpr int64_t kTile = 16;   // output columns per zmm of int32 sums

// Prefetch a weight's bytes ahead of the tile loop, with the hint this machine does best with
// (kernels/prefetch.py measures and sets it: set_prefetch). Two kinds of weight: a streamed one
// (the target model's: ~94 MB a step for SmolLM2, more than most L3s) and a kept one, read again
// soon (a draft's, its reduced LM head). Non-temporal prefetches keep a streamed weight from
// evicting what the next step reads again (a few % on a Zen 4); on a VM whose loads wait long
// for memory they made a step 2.6x as long, where fetching into L2 (T1) lets more lines be in flight:
// the best hint is a property of the machine, not of the code.
// How far ahead is the machine's too: a loop one group (320-512 bytes) ahead of its loads needs
// the prefetch `distance` bytes ahead to have landed by then, and where memory answers slowly
// (that VM, its L3 included) 2.5 KB ahead left each group waiting: 10 KB made its step ~20% shorter.
enum PrefetchHint : int { kHintT0 = 0, kHintT1 = 1, kHintT2 = 2, kHintNta = 3, kHintNone = 4 };
inline int g_prefetch_hint[2] = {kHintT0, kHintNta};  // [kept, streamed]
constexpr int64_t kDistanceDefault = 2560;  // bytes ahead (8 int4 groups: the distance before wave 46)
inline int64_t g_prefetch_distance[2] = {kDistanceDefault, kDistanceDefault};  // [kept, streamed]

// Each hint is its own volatile instruction: GCC 12 merges _mm_prefetch calls of different hints in
// one switch into a single call whose hint is no longer a constant, and then drops them all.
// Prefetches the line `offset` bytes past the kind's distance ahead of `at` (a loop's current group).
inline void prefetch_weight(const uint8_t* at, int64_t offset, bool stream) {
  const char* c = reinterpret_cast<const char*>(at + g_prefetch_distance[stream ? 1 : 0] + offset);
  switch (g_prefetch_hint[stream ? 1 : 0]) {
    case kHintT0: asm volatile("prefetcht0 %0" : : "m"(*c)); break;
    case kHintT1: asm volatile("prefetcht1 %0" : : "m"(*c)); break;
    case kHintT2: asm volatile("prefetcht2 %0" : : "m"(*c)); break;
    case kHintNta: asm volatile("prefetchnta %0" : : "m"(*c)); break;
    default: break;  // none: the hardware prefetchers alone
  }
}

#if defined(EVOSPEC_ZMM)
constexpr const char* kIsa = "avx512-vnni";
#elif defined(__AVXVNNI__)
constexpr const char* kIsa = "avx-vnni";
#else
constexpr const char* kIsa = "avx2";
#endif

// 16 int32 lanes and 16 float32 lanes: a zmm, or two ymm halves (lanes 0-7, 8-15).
#ifdef EVOSPEC_ZMM
using IV = __m512i;
using FV = __m512;
inline IV iv_zero() { return _mm512_setzero_si512(); }
inline IV iv_load(const uint8_t* p) { return _mm512_loadu_si512(p); }  // 64 bytes: 4 per lane
inline IV iv_add(IV a, IV b) { return _mm512_add_epi32(a, b); }
inline IV iv_sub(IV a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline IV nibbles_lo(IV v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
inline IV nibbles_hi(IV v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
// acc + per lane the sum of its 4 unsigned weight bytes times the 4 signed codes in c4
inline IV dot4_u4(IV acc, IV w, int32_t c4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(c4)); }
inline IV dot4_u8(IV acc, IV w, int32_t c4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(c4)); }
constexpr bool kU8Offset = true;  // dot4_u8 sums u c = w c + 128 c: the tile loop takes 128 sum c off
inline FV fv_zero() { return _mm512_setzero_ps(); }
inline FV fv_set(float x) { return _mm512_set1_ps(x); }
inline FV fv_load(const float* p) { return _mm512_loadu_ps(p); }
inline FV fv_f16(const uint8_t* p) {  // 16 float16 -> float32 (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline FV fv_cvt(IV a) { return _mm512_cvtepi32_ps(a); }
inline FV fv_add(FV a, FV b) { return _mm512_add_ps(a, b); }
inline FV fv_mul(FV a, FV b) { return _mm512_mul_ps(a, b); }
inline void fv_store(float* p, FV v) { _mm512_storeu_ps(p, v); }
#else
struct IV {
  __m256i lo, hi;
};
struct FV {
  __m256 lo, hi;
};
inline IV iv_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline IV iv_load(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline IV iv_add(IV a, IV b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline IV iv_sub(IV a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline IV nibbles_lo(IV v) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(v.lo, m), _mm256_and_si256(v.hi, m)};
}
inline IV nibbles_hi(IV v) {
  const __m256i m = _mm256_set1_epi8(0x0f);
  return {_mm256_and_si256(_mm256_srli_epi16(v.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), m)};
}
#ifdef __AVXVNNI__
inline __m256i dot4_half(__m256i acc, __m256i w, __m256i c) { return _mm256_dpbusd_avx_epi32(acc, w, c); }
inline IV dot4_u4(IV acc, IV w, int32_t c4) {
  const __m256i c = _mm256_set1_epi32(c4);
  return {dot4_half(acc.lo, w.lo, c), dot4_half(acc.hi, w.hi, c)};
}
inline IV dot4_u8(IV acc, IV w, int32_t c4) { return dot4_u4(acc, w, c4); }
constexpr bool kU8Offset = true;  // dot4_u8 sums u c = w c + 128 c: the tile loop takes 128 sum c off
#else  // (int4 weights on plain AVX2: group_dots_u4's 16-bit sums)
// Weights u = w + 128 (1..255): sum u c = sum w c + 128 sum c, with w c formed as |w| (sign(w) c)
// (pairs at most 2 * 127 * 127 = 32,258: no saturation; codes are never -128).
inline __m256i dot4_u8_half(__m256i acc, __m256i u, __m256i c, __m256i ones) {
  const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(c, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
}
// Here acc gains sum w c alone, not VPDPBUSD's sum u c: the 128 sum c that VPDPBUSD adds and the
// tile loop then takes off again (kU8Offset) is never added (integers: the same sums, without a
// scalar code sum and two adds per row and step).
constexpr bool kU8Offset = false;
inline IV dot4_u8(IV acc, IV w, int32_t c4) {
  const __m256i cv = _mm256_set1_epi32(c4), ones = _mm256_set1_epi16(1);
  return {dot4_u8_half(acc.lo, w.lo, cv, ones), dot4_u8_half(acc.hi, w.hi, cv, ones)};
}
#endif
inline FV fv_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline FV fv_set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline FV fv_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline FV fv_f16(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline FV fv_cvt(IV a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline FV fv_add(FV a, FV b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline FV fv_mul(FV a, FV b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline void fv_store(float* p, FV v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#endif

// Per row r < NR: the group's 16 dot products of 32 int4 weights (w[j]: lane l's 4 weights of
// inputs 4j..4j+3, 0..15) with the row's 32 codes (codes + r * k). VPDPBUSD builds chain the
// 8 steps over independent accumulators (kChains) so the rows' multiply-adds overlap; the AVX2
// build sums VPMADDUBSW's 16-bit pairs over all 8 steps before one VPMADDWD (8 * 2 * 15 * 127 =
// 30,480: no overflow). Integer sums: the same values either way.
template <int NR>
inline void group_dots_u4(const IV* w, const int8_t* codes, int64_t k, IV* out) {
#if defined(EVOSPEC_ZMM) || defined(__AVXVNNI__)
#ifdef EVOSPEC_ZMM
  constexpr int kChains = NR == 1 ? 4 : NR <= 4 ? 2 : 1;  // past 4 rows the rows are the chains
#else
  constexpr int kChains = NR == 1 ? 2 : 1;  // two ymm halves a chain, and 16 ymm registers in all
#endif
  IV d[NR][kChains];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < kChains; ++c) d[r][c] = iv_zero();
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < NR; ++r) {
      int32_t cj;
      std::memcpy(&cj, codes + r * k + 4 * j, sizeof cj);
      d[r][j % kChains] = dot4_u4(d[r][j % kChains], w[j], cj);
    }
  for (int r = 0; r < NR; ++r) {
    out[r] = d[r][0];
    for (int c = 1; c < kChains; ++c) out[r] = iv_add(out[r], d[r][c]);
  }
#else
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < NR; ++r) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      int32_t cj;
      std::memcpy(&cj, codes + r * k + 4 * j, sizeof cj);
      const __m256i c = _mm256_set1_epi32(cj);
      lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(w[j].lo, c));
      hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(w[j].hi, c));
    }
    out[r] = {_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)};
  }
#endif
}

// One row's groups: int8 codes (`k` bytes), the scale and the code sum of each group.
inline void quantize_row(const float* x, int64_t k, int8_t* codes, float* scale, float* sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const float* xg = x + g * kGroup;
#ifdef EVOSPEC_ZMM
    const __m512 v0 = _mm512_loadu_ps(xg), v1 = _mm512_loadu_ps(xg + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vi));  // nearest even (MXCSR default)
    const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup), _mm512_cvtsepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + g * kGroup + 16), _mm512_cvtsepi32_epi8(c1));
    scale[g] = amax / 127.0f;
    sum[g] = static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
#else
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i] = _mm256_loadu_ps(xg + 8 * i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));  // max: exact in any order
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = std::max(_mm_cvtss_f32(h), _mm_cvtss_f32(_mm_shuffle_ps(h, h, 1)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi));  // nearest even
    // int32 -> int8 saturated (VPACKSSDW, VPACKSSWB), the 128-bit lanes' interleave undone
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + g * kGroup), ordered);
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
    scale[g] = amax / 127.0f;
    sum[g] = static_cast<float>(_mm_cvtsi128_si32(u));
#endif
  }
}

// The codes of every row of x (float32 or bfloat16 [M, K], contiguous): codes [M, K], scale
// and code sum [M, K/32]. Quantised on the calling thread (~1 us a row; waking the pool would
// cost more), into buffers kept per calling thread; workers read them through these pointers.
struct ActivationCodes {
  const int8_t* codes;
  const float* scale;
  const float* sum;
};

inline ActivationCodes quantize_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  thread_local std::vector<int8_t> codes_buf;
  thread_local std::vector<float> scale_buf, sum_buf, row;
  codes_buf.resize(m * k);
  scale_buf.resize(m * groups);
  sum_buf.resize(m * groups);
  row.resize(bf16 ? k : 0);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * k;
      for (int64_t i = 0; i < k; ++i) row[i] = evospec_bf16::bf16_to_f32(src[i]);
      xr = row.data();
    } else {
      xr = x.data_ptr<float>() + r * k;
    }
    quantize_row(xr, k, codes_buf.data() + r * k, scale_buf.data() + r * groups, sum_buf.data() + r * groups);
  }
  return {codes_buf.data(), scale_buf.data(), sum_buf.data()};
}

// Store 16 float32 sums as the output's dtype (float32, or bfloat16 rounded to nearest even).
template <typename Out>
inline void store_tile(Out* out, FV v) {
  if constexpr (sizeof(Out) == 4) {
    fv_store(reinterpret_cast<float*>(out), v);
  } else {
    float f[kTile];
    fv_store(f, v);
    for (int64_t i = 0; i < kTile; ++i) out[i] = evospec_bf16::f32_to_bf16(f[i]);
  }
}

}  // namespace evospec_vnni

#endif

// What other layouts would save in decode attention, on this CPU (a standalone
// benchmark; no part of the op library). R query rows (one KV head's query heads, times a chain's
// rows) against S cached keys of 64 dims; the scores four ways:
//   rows:   keys as the cache holds them ([S][64] f16), a block of 16 converted to f32 once, each
//           row's 16 dot products by FMAs and a 16-vector transpose-reduce (attention.cpp's
//           score_rows / reduce16 shape, its 15 adds and 30 two-source shuffles);
//   f16t:   keys stored transposed in blocks of 16 ([S/16][64][16] f16), a block converted once,
//           each row broadcasting q[d] into 64 FMAs whose 16 lanes are the 16 keys' scores (no
//           reduce; float32 arithmetic, other summation order);
//   bf16t:  the same blocks in bf16 pairs ([S/16][32][16][2]), q rounded to bf16, `vdpbf16ps`
//           (32 multiply-adds an instruction; bf16 rounding of q and k);
//   amx:    the bf16t blocks as AMX-BF16 B tiles, the rows (<= 16) as A tiles: two TDPBF16PS per
//           16 keys (where the compiler targets AMX and Linux grants the tile state);
//   amx16:  tiles over the engine's f16 layout as it is: each block of 16 keys converted to bf16
//           rows and used as A tiles against the queries as B tiles (S^T = K Q^T).
// Then the weighted sum of values (the engine's per-key FMAs over f16 values, against AMX tiles
// over bf16 probabilities and values in key-pair blocks). Prints ns per (row, key) and each way's
// largest error against a float64 reference. Used for docs/benchmarks.md, wave 26:
//
//   g++ -O3 -march=native -o /tmp/attention_layouts scripts/attention_layouts.cpp   # AVX-512 BF16 (AMX: optional)
//   /tmp/attention_layouts [rows=3] [keys=320, a multiple of 32] [calls=20000]
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kDh = 64;

// v[j] = sum of a[j]'s 16 lanes, by a tree of shuffles and adds (the engine's reduce16 structure)
__m512 reduce16(const __m512* a) {
  const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i lo2 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i hi2 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const __m512i lo1 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i hi1 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)
    c[i] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * i], lo8, a[2 * i + 1]),
                         _mm512_permutex2var_ps(a[2 * i], hi8, a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    e[i] = _mm512_add_ps(_mm512_permutex2var_ps(c[2 * i], lo4, c[2 * i + 1]),
                         _mm512_permutex2var_ps(c[2 * i], hi4, c[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    f[i] = _mm512_add_ps(_mm512_permutex2var_ps(e[2 * i], lo2, e[2 * i + 1]),
                         _mm512_permutex2var_ps(e[2 * i], hi2, e[2 * i + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(f[0], lo1, f[1]), _mm512_permutex2var_ps(f[0], hi1, f[1]));
}

__m512 cvt16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

void scores_rows(const float* q, const uint16_t* k, int rows, int keys, float* out) {
  alignas(64) float kb[16 * kDh];
  for (int tb = 0; tb < keys; tb += 16) {
    for (int j = 0; j < 16; ++j)
      for (int d = 0; d < kDh; d += 16) _mm512_store_ps(kb + j * kDh + d, cvt16(k + (tb + j) * kDh + d));
    for (int r = 0; r < rows; ++r) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + r * kDh), _mm512_load_ps(kb + j * kDh));
        for (int d = 16; d < kDh; d += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * kDh + d), _mm512_load_ps(kb + j * kDh + d), acc);
        a[j] = acc;
      }
      _mm512_storeu_ps(out + r * keys + tb, reduce16(a));
    }
  }
}

void scores_f16t(const float* q, const uint16_t* kt, int rows, int keys, float* out) {
  alignas(64) float kb[kDh * 16];
  for (int tb = 0; tb < keys; tb += 16) {
    const uint16_t* blk = kt + tb * kDh;
    for (int d = 0; d < kDh; ++d) _mm512_store_ps(kb + d * 16, cvt16(blk + d * 16));
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + r * kDh;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int d = 0; d < kDh; d += 4)
        for (int c = 0; c < 4; ++c)
          acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(qr[d + c]), _mm512_load_ps(kb + (d + c) * 16), acc[c]);
      _mm512_storeu_ps(out + r * keys + tb, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
  }
}

void scores_bf16t(const uint16_t* qb, const uint16_t* kt, int rows, int keys, float* out) {
  for (int tb = 0; tb < keys; tb += 16) {
    const uint16_t* blk = kt + tb * kDh;
    for (int r = 0; r < rows; ++r) {
      const uint16_t* qr = qb + r * kDh;  // bf16 pairs, broadcast 32 bits at a time
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int p = 0; p < kDh / 2; p += 4)
        for (int c = 0; c < 4; ++c) {
          int32_t pair;
          std::memcpy(&pair, qr + 2 * (p + c), sizeof pair);
          acc[c] = _mm512_dpbf16_ps(acc[c], (__m512bh)_mm512_set1_epi32(pair),
                                    (__m512bh)_mm512_loadu_si512(blk + (p + c) * 32));
        }
      _mm512_storeu_ps(out + r * keys + tb, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    }
  }
}

// AMX: tile A = up to 16 query rows x 32 bf16 (64 bytes), tile B = the key block's 16 bf16 pairs x
// 16 keys (the bf16t layout, 32 dims), tile C = rows x 16 keys in float32; two TDPBF16PS per 16 keys.
struct TileConfig {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_ready() {
#ifdef __AMX_BF16__
  constexpr long kReqPerm = 0x1023, kXtiledata = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  return syscall(SYS_arch_prctl, kReqPerm, kXtiledata) == 0;
#else
  return false;
#endif
}

#ifdef __AMX_BF16__
void scores_amx(const uint16_t* qb, const uint16_t* kt, int rows, int keys, float* out) {
  TileConfig cfg;
  cfg.rows[0] = rows, cfg.colsb[0] = 64;          // C: rows x 16 float32
  cfg.rows[1] = rows, cfg.colsb[1] = 64;          // A: rows x 32 bf16 (dims 0-31)
  cfg.rows[2] = rows, cfg.colsb[2] = 64;          // A: dims 32-63
  cfg.rows[3] = 16, cfg.colsb[3] = 64;            // B: 16 pairs x 16 keys x 2 (dims 0-31)
  cfg.rows[4] = 16, cfg.colsb[4] = 64;            // B: dims 32-63
  _tile_loadconfig(&cfg);
  _tile_loadd(1, qb, kDh * 2);
  _tile_loadd(2, qb + 32, kDh * 2);
  alignas(64) float c[16 * 16];
  for (int tb = 0; tb < keys; tb += 16) {
    const uint16_t* blk = kt + tb * kDh;
    _tile_zero(0);
    _tile_loadd(3, blk, 64);
    _tile_loadd(4, blk + 16 * 32, 64);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, c, 64);  // a contiguous block (a strided store into out aliases at some sizes)
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(out + r * keys + tb, _mm512_load_ps(c + r * 16));
  }
  _tile_release();
}

// Scores on tiles straight from the engine's f16 cache layout: each block of 16 keys converted to
// bf16 rows (no transposition), then S^T = K Q^T with the keys as A tiles (dims 0-31, 32-63) and
// the rows' queries as one B tile pair, laid out once per call; the 16 x rows result is stored
// transposed into out [rows][keys].
void scores_amx_f16(const uint16_t* qt, const uint16_t* k, int rows, int keys, float* out) {
  TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = rows * 4;  // C: 16 keys x rows float32
  cfg.rows[1] = 16, cfg.colsb[1] = 64;        // A: 16 keys x 32 bf16 (dims 0-31)
  cfg.rows[2] = 16, cfg.colsb[2] = 64;        // A: dims 32-63
  cfg.rows[3] = 16, cfg.colsb[3] = rows * 4;  // B: 16 dim pairs x rows x 2 (dims 0-31)
  cfg.rows[4] = 16, cfg.colsb[4] = rows * 4;  // B: dims 32-63
  _tile_loadconfig(&cfg);
  _tile_loadd(3, qt, rows * 4);
  _tile_loadd(4, qt + 16 * rows * 2, rows * 4);
  alignas(64) uint16_t kb[16 * kDh];
  alignas(64) float c[16 * 16];
  for (int tb = 0; tb < keys; tb += 16) {
    for (int j = 0; j < 16; ++j) {
      const uint16_t* kj = k + (tb + j) * kDh;
      const __m512 f0 = cvt16(kj), f1 = cvt16(kj + 16), f2 = cvt16(kj + 32), f3 = cvt16(kj + 48);
      _mm512_store_si512(kb + j * kDh, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));
      _mm512_store_si512(kb + j * kDh + 32, (__m512i)_mm512_cvtne2ps_pbh(f3, f2));
    }
    _tile_zero(0);
    _tile_loadd(1, kb, kDh * 2);
    _tile_loadd(2, kb + 32, kDh * 2);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
    _tile_stored(0, c, rows * 4);
    for (int j = 0; j < 16; ++j)
      for (int r = 0; r < rows; ++r) out[r * keys + tb + j] = c[j * rows + r];
  }
  _tile_release();
}

// The weighted sum on tiles: probabilities as bf16 A tiles (rows x 32 keys, each block contiguous:
// [S/32][rows][32]), values in key-pair blocks as B tiles ([S/32][4 slabs][16 pairs][16 dims][2]),
// four float32 C tiles (rows x 16 dims).
void weigh_amx(const uint16_t* pb, const uint16_t* vt, int rows, int keys, float* out) {
  TileConfig cfg;
  for (int c = 0; c < 5; ++c) cfg.rows[c] = rows, cfg.colsb[c] = 64;  // C0-C3, A
  cfg.rows[5] = 16, cfg.colsb[5] = 64;                                 // B
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int tb = 0; tb < keys; tb += 32) {
    const uint16_t* blk = vt + tb * kDh;
    _tile_loadd(4, pb + tb * rows, 64);  // the block's probabilities: [rows][32] bf16, contiguous
    _tile_loadd(5, blk, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, blk + 512, 64);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, blk + 1024, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, blk + 1536, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, kDh * 4);
  _tile_stored(1, out + 16, kDh * 4);
  _tile_stored(2, out + 32, kDh * 4);
  _tile_stored(3, out + 48, kDh * 4);
  _tile_release();
}
#endif

// The engine's weighted sum (attention.cpp's weigh): per key, its 64 f16 values converted once
// and multiplied into every row's four accumulators by the row's broadcast probability.
void weigh_rows(const float* p, const uint16_t* v, int rows, int keys, float* out) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int nr = rows - r0 < 4 ? rows - r0 : 4;
    __m512 acc[4][4];
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int t = 0; t < keys; ++t) {
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = cvt16(v + t * kDh + 16 * c);
      for (int r = 0; r < nr; ++r) {
        const __m512 w = _mm512_set1_ps(p[(r0 + r) * keys + t]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + (r0 + r) * kDh + 16 * c, acc[r][c]);
  }
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// Runs fn once to check `got` against `want`, then `calls` times; prints ns per (row, key) and the
// largest error; returns the total ns.
template <typename Fn>
double measure(const char* name, Fn fn, const std::vector<float>& got, const std::vector<float>& want, int calls,
               int per_call, const char* what) {
  fn();
  double err = 0;
  for (size_t i = 0; i < want.size(); ++i) err = std::fmax(err, std::fabs(got[i] - want[i]));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) {
    fn();
    asm volatile("" ::: "memory");
  }
  const double ns = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9;
  std::printf("%-6s %.3f ns per (row, key), max |error| %.6f%s\n", name, ns / calls / per_call, err, what);
  return ns;
}

bool use_amx(int rows) {
#ifdef __AMX_BF16__
  return rows <= 16 && amx_ready();
#else
  return false;
#endif
}

void bench_scores(int rows, int keys, int calls) {
  std::vector<float> q(rows * kDh), ref(rows * keys), out(rows * keys);
  std::vector<uint16_t> k(keys * kDh), kt(keys * kDh), ktb(keys * kDh), qb(rows * kDh), qt(rows * kDh);
  for (auto& x : q) x = (std::rand() % 2001 - 1000) / 1000.0f;
  for (int t = 0; t < keys; ++t)
    for (int d = 0; d < kDh; ++d) {
      const uint16_t h = _cvtss_sh((std::rand() % 2001 - 1000) / 1000.0f, 0);
      k[t * kDh + d] = h;
      kt[(t / 16) * kDh * 16 + d * 16 + t % 16] = h;
      ktb[(t / 16) * kDh * 16 + (d / 2) * 32 + (t % 16) * 2 + d % 2] = to_bf16(_cvtsh_ss(h));
    }
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < kDh; ++d) {
      qb[r * kDh + d] = to_bf16(q[r * kDh + d]);
      qt[(d / 2) * rows * 2 + r * 2 + d % 2] = qb[r * kDh + d];  // B tiles: [dim pairs][rows][2]
    }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < keys; ++t) {
      double s = 0;
      for (int d = 0; d < kDh; ++d) s += static_cast<double>(q[r * kDh + d]) * _cvtsh_ss(k[t * kDh + d]);
      ref[r * keys + t] = static_cast<float>(s);
    }
  auto run = [&](const char* name, auto fn) { return measure(name, fn, out, ref, calls, rows * keys, ""); };
  const double a = run("rows", [&] { scores_rows(q.data(), k.data(), rows, keys, out.data()); });
  const double b = run("f16t", [&] { scores_f16t(q.data(), kt.data(), rows, keys, out.data()); });
  const double c = run("bf16t", [&] { scores_bf16t(qb.data(), ktb.data(), rows, keys, out.data()); });
  std::printf("f16t %.2fx, bf16t %.2fx the engine's layout\n", a / b, a / c);
#ifdef __AMX_BF16__
  if (use_amx(rows)) {
    const double d = run("amx", [&] { scores_amx(qb.data(), ktb.data(), rows, keys, out.data()); });
    std::printf("amx %.2fx the engine's layout\n", a / d);
    const double e = run("amx16", [&] { scores_amx_f16(qt.data(), k.data(), rows, keys, out.data()); });
    std::printf("amx16 (the f16 cache as it is, converted per block) %.2fx the engine's layout\n", a / e);
  }
#endif
}

// The weighted sum of values, with probabilities that sum to 1 per row.
void bench_weighted_sum(int rows, int keys, int calls) {
  std::vector<float> pr(rows * keys), ref(rows * kDh), out(rows * kDh);
  std::vector<uint16_t> v(keys * kDh), vt(keys * kDh), pb(rows * keys);
  for (int r = 0; r < rows; ++r) {
    double total = 0;
    for (int t = 0; t < keys; ++t) total += pr[r * keys + t] = static_cast<float>(std::rand() % 1000 + 1);
    for (int t = 0; t < keys; ++t)  // tiles: [S/32][rows][32]
      pb[(t / 32) * rows * 32 + r * 32 + t % 32] = to_bf16(pr[r * keys + t] /= static_cast<float>(total));
  }
  for (int t = 0; t < keys; ++t)
    for (int d = 0; d < kDh; ++d) {
      const uint16_t h = _cvtss_sh((std::rand() % 2001 - 1000) / 1000.0f, 0);
      v[t * kDh + d] = h;  // tiles: [S/32][slab][pair][dim][2]
      vt[(t / 32) * 32 * kDh + (d / 16) * 512 + ((t % 32) / 2) * 32 + (d % 16) * 2 + t % 2] = to_bf16(_cvtsh_ss(h));
    }
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < kDh; ++d) {
      double s = 0;
      for (int t = 0; t < keys; ++t) s += static_cast<double>(pr[r * keys + t]) * _cvtsh_ss(v[t * kDh + d]);
      ref[r * kDh + d] = static_cast<float>(s);
    }
  auto run = [&](const char* name, auto fn) {
    return measure(name, fn, out, ref, calls, rows * keys, " (weighted sum)");
  };
  const double a = run("rows", [&] { weigh_rows(pr.data(), v.data(), rows, keys, out.data()); });
#ifdef __AMX_BF16__
  if (use_amx(rows)) {
    const double d = run("amx", [&] { weigh_amx(pb.data(), vt.data(), rows, keys, out.data()); });
    std::printf("amx %.2fx the engine's weighted sum\n", a / d);
  }
#endif
  (void)a;
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 3;
  const int keys = (argc > 2 ? std::atoi(argv[2]) : 320) / 32 * 32;
  const int calls = argc > 3 ? std::atoi(argv[3]) : 20000;
  if (rows < 1 || keys < 32 || calls < 1) {
    std::fprintf(stderr, "usage: %s [rows >= 1] [keys >= 32] [calls >= 1]\n", argv[0]);
    return 2;
  }
  std::srand(7);
  std::printf("%d rows x %d keys x %d dims, %d calls\n", rows, keys, kDh, calls);
  bench_scores(rows, keys, calls);
  bench_weighted_sum(rows, keys, calls);
  return 0;
}

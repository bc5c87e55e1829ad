// 8-bit weight x 8-bit activation matmul for the CPU (AVX-512 VNNI, AVX-VNNI or AVX2: vnni.h),
// registered as a torch op.
//
// Contract (see int8_matmul.py for the packing and the torch reference):
//   int8_matmul(x f32 or bf16 [M, K], packed u8 [N/16, K/32, 512], scale f32 [N], stream = false)
//     -> x's dtype [M, N]; stream: the weight is read once a forward (vnni.h, prefetch_weight)
//   int8_rows(packed, ids int64 [a]) -> int8 [a, K]: rows of codes back from the tiles
// Weights: w[n, k] = (u - 128) * scale[n], u in 1..255 (symmetric int8 codes plus 128, so that
// vpdpbusd, unsigned x signed, takes them as they lie). Tile t holds outputs 16t..16t+15; its
// group g is 512 contiguous bytes: 8 blocks of 64, block j byte 4 l + i holding
// u[16t + l, 32g + 4j + i]. Activations: int8 codes c per row and group of 32 with scale a
// (vnni.h). Per row, in float32, over the groups in order (-ffp-contract=off):
//   acc += a * float(sum_k u_k c_k - 128 sum_k c_k);   y = acc * scale
// then one rounding to bf16 for bf16 inputs. A row's bits depend only on that row.
//
// Why: the LM head is the largest single matmul of a small model's step (SmolLM2: 49,152 x
// 576, 28 MB of int8). torch's int8 kernel takes bf16 activations and returns bf16, so each
// extra verified row cost it ~0.6 ms and its logits needed a float32 copy; here the rows share
// one read of each tile and the logits come out in x's dtype.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "vnni.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(EVOSPEC_ZMM)
constexpr int64_t kRows = 8;     // activation rows sharing one read of a weight group (32 zmm)
#else
constexpr int64_t kRows = 4;     // (16 ymm registers: past 4 rows the sums would spill)
#endif
constexpr int64_t kBlock = 512;  // bytes per tile group: 16 outputs x 32 inputs

#ifdef EVOSPEC_VNNI

using evospec_vnni::kGroup;
using evospec_vnni::kTile;
using evospec_vnni::prefetch_weight;

// Rows 0..NR-1 of one tile: out[r * n + 0..15]. As in int4_matmul.cpp, each row's 8 dot
// products go to independent int32 chains (integer sums: exact in any order).
template <int NR, typename Out>
void tile_rows(const uint8_t* packed, const float* wscale, int64_t groups, const int8_t* codes,
               const float* ascale, const float* asum, int64_t k, Out* out, int64_t n, bool stream) {
  using namespace evospec_vnni;
#ifdef EVOSPEC_ZMM
  constexpr int kChains = NR == 1 ? 4 : NR <= 4 ? 2 : 1;  // past 4 rows the rows are the chains
#else
  constexpr int kChains = NR == 1 ? 2 : 1;  // two ymm halves a chain, and 16 ymm registers in all
#endif
  FV acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = fv_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wp = packed + g * kBlock;
    for (int b = 0; b < 8; ++b) prefetch_weight(wp, 64 * b, stream);  // (past the end: harmless)
    IV d[NR][kChains];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < kChains; ++c) d[r][c] = iv_zero();
    for (int j = 0; j < 8; ++j) {
      const IV w = iv_load(wp + 64 * j);
      for (int r = 0; r < NR; ++r) {
        int32_t cj;
        std::memcpy(&cj, codes + r * k + g * kGroup + 4 * j, sizeof cj);
        d[r][j % kChains] = dot4_u8(d[r][j % kChains], w, cj);
      }
    }
    for (int r = 0; r < NR; ++r) {
      IV dr = d[r][0];
      for (int c = 1; c < kChains; ++c) dr = iv_add(dr, d[r][c]);
      if (kU8Offset) dr = iv_sub(dr, 128 * static_cast<int32_t>(asum[r * groups + g]));  // the weights' +128
      const FV t = fv_cvt(dr);
      acc[r] = fv_add(acc[r], fv_mul(fv_set(ascale[r * groups + g]), t));
    }
  }
  const FV ws = fv_load(wscale);
  for (int r = 0; r < NR; ++r) store_tile(out + r * n, fv_mul(acc[r], ws));
}

template <typename Out>
void tile_block(int64_t nr, const uint8_t* packed, const float* wscale, int64_t groups, const int8_t* codes,
                const float* ascale, const float* asum, int64_t k, Out* out, int64_t n, bool stream) {
  switch (nr) {
    case 1: return tile_rows<1>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    case 2: return tile_rows<2>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    case 3: return tile_rows<3>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
#if defined(EVOSPEC_ZMM)
    case 4: return tile_rows<4>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    case 5: return tile_rows<5>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    case 6: return tile_rows<6>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    case 7: return tile_rows<7>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
    default: return tile_rows<8>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
#else
    default: return tile_rows<4>(packed, wscale, groups, codes, ascale, asum, k, out, n, stream);
#endif
  }
}

#endif

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, bool stream) {
#ifndef EVOSPEC_VNNI
  TORCH_CHECK(false, "int8_matmul: this build has no int8-activation kernel (AVX2 or later; check int4_vnni() first)");
  return x;
#else
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_matmul: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(), "int8_matmul: packed must be contiguous uint8 [N/16, K/32, 512]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), groups = packed.size(1), n = tiles * kTile;
  TORCH_CHECK(k == groups * kGroup, "int8_matmul: x has ", k, " columns, the weight ", groups * kGroup);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == n && scale.is_contiguous(),
              "int8_matmul: scale must be contiguous float32 [", n, "]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto act = evospec_vnni::quantize_rows(xc);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  void* op = out.data_ptr();
  // Threads split the output tiles; each runs every row block over a tile while it is in L1.
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const uint8_t* wt = wp + t * groups * kBlock;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t nr = std::min(kRows, m - r0);
        const int8_t* c = act.codes + r0 * k;
        const float *as = act.scale + r0 * groups, *su = act.sum + r0 * groups;
        const float* ws = sp + t * kTile;
        if (bf16)
          tile_block(nr, wt, ws, groups, c, as, su, k, static_cast<uint16_t*>(op) + r0 * n + t * kTile, n, stream);
        else
          tile_block(nr, wt, ws, groups, c, as, su, k, static_cast<float*>(op) + r0 * n + t * kTile, n, stream);
      }
    }
  });
  return out;
#endif
}

// Rows `ids` [a] of a packed weight as int8 codes [a, K] (int8_matmul.py: read_int8_rows): row n
// is lane n % 16 of tile n / 16, 4 codes of each of a group's 8 blocks. What the vocabulary heads
// gather, now that the tiles are the only copy of the weight.
at::Tensor int8_rows(const at::Tensor& packed, const at::Tensor& ids) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(), "int8_rows: packed must be contiguous uint8 [N/16, K/32, 512]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "int8_rows: ids must be int64 [a]");
  const int64_t tiles = packed.size(0), groups = packed.size(1), k = groups * 32, a = ids.size(0);
  const auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t r = 0; r < a; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < tiles * 16, "int8_rows: row ", id[r], " is outside the weight");
  auto out = at::empty({a, k}, packed.options().dtype(at::kChar));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  int8_t* o = out.data_ptr<int8_t>();
  // in row order: the rows of one tile share its cache lines (each holds 4 codes of 16 rows)
  std::vector<int64_t> order(a);
  for (int64_t r = 0; r < a; ++r) order[r] = r;
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return id[x] < id[y]; });
  at::parallel_for(0, a, 256, [&](int64_t first, int64_t last) {
    for (int64_t q = first; q < last; ++q) {
      const int64_t r = order[q], t = id[r] / 16, lane = id[r] % 16;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* src = p + (t * groups + g) * kBlock + lane * 4;
        int8_t* dst = o + r * k + g * 32;
        for (int j = 0; j < 8; ++j) {  // 4 codes a block: u - 128 as int8 is u ^ 0x80, a byte at a time
          uint32_t w;
          std::memcpy(&w, src + 64 * j, 4);
          w ^= 0x80808080u;
          std::memcpy(dst + 4 * j, &w, 4);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evospec, m) {
  m.def("int8_matmul(Tensor x, Tensor packed, Tensor scale, bool stream=False) -> Tensor");
  m.def("int8_rows(Tensor packed, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) {
  m.impl("int8_matmul", &int8_matmul);
  m.impl("int8_rows", &int8_rows);
}

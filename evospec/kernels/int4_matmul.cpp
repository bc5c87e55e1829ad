// 4-bit weight x 8-bit activation matmul for the CPU (AVX-512 VNNI, AVX-VNNI or AVX2: vnni.h),
// registered as torch ops.
//
// Contract (see int4_matmul.py for the packing and the torch reference):
//   int4_vnni() -> bool: whether this build has the kernel (compiled for AVX2 + FMA + F16C or later)
//   int4_isa() -> str: which instruction set it uses ("avx512-vnni", "avx-vnni", "avx2"; "none")
//   set_prefetch(kept, streamed) -> (): the prefetch hints of the weight loops (vnni.h,
//     prefetch_weight; 0 T0, 1 T1, 2 T2, 3 NTA, 4 none), for every op of this library; a no-op
//     in a build without the kernels
//   prefetch_hints() -> int[2]: the hints in use, [kept, streamed]
//   set_prefetch_distance(kept, streamed) -> (): how many bytes ahead of its loads each loop prefetches
//     (64..65536, a multiple of 64), for every op of this library; a no-op without the kernels
//   prefetch_distances() -> int[2]: the distances in use, [kept, streamed]
//   int4_block_rows() -> int: the activation rows one pass over a weight tile takes (8 on AVX-512,
//                             4 elsewhere: int4_tiles.h, kRows)
//   int4_matmul(x f32 or bf16 [M, K], packed u8 [N/16, K/32, 320], stream = false) -> x's dtype [M, N];
//     stream: the weight is read once a forward (vnni.h, prefetch_weight)
//   int4_top1(x f32 [M, K], packed [C16/16, K/32, 320], bias f32 [C], ids i64 [C]) -> (logp f32 [M, 1],
//     id i64 [M, 1]): per row, the largest of the first C outputs plus bias (the first on a tie), its
//     log-softmax over those C, and ids[its column] -- a reduced LM head's top-1 in one call (bias
//     -inf: a free slot, never picked while any slot is finite)
// Weights: w[n, k] = q * scale[n, g] + zero[n, g] for q in 0..15 (g = k / 32). Tile t holds
// outputs 16t..16t+15; its group g is 320 contiguous bytes (one stream to read): 4 blocks of 64,
// block b byte 4 l + j holding q[16t + l, 32g + 8b + j] in its low nibble and
// q[16t + l, 32g + 8b + 4 + j] in its high one, then the 16 scales and the 16 zeros (float16).
// Activations: each row's group of 32 is quantised to int8 by its own scale a = max|x| / 127
// (codes rounded to nearest even), as llama.cpp's Q8_0. Per row and group, in float32:
//   y += a * (scale * float(sum_k q_k c_k) + zero * float(sum_k c_k))
// over the groups in order (-ffp-contract=off: no fused multiply-adds), then one rounding to
// bf16 for bf16 inputs. A row's bits depend only on that row: one-token steps and verified
// chains agree bitwise, whatever M and the thread split.
//
// Why: a verify forward's extra rows are compute, not weight reads. torch's int4 kernel takes
// bf16 activations and runs float FMAs (~1.1 ms per extra SmolLM2 row on two Zen 4 cores);
// VNNI's vpdpbusd does 64 int8 multiply-adds per instruction.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "fastexp.h"
#include "int4_tiles.h"
#include "vnni.h"

#include <cmath>
#include <limits>
#include <tuple>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using namespace evospec_int4;

bool int4_vnni() {
#ifdef EVOSPEC_VNNI
  return true;
#else
  return false;
#endif
}

void set_prefetch(int64_t kept, int64_t streamed) {
  TORCH_CHECK(kept >= 0 && kept <= 4 && streamed >= 0 && streamed <= 4, "set_prefetch: hints are 0..4, got ", kept,
              ", ", streamed);
#ifdef EVOSPEC_VNNI
  evospec_vnni::g_prefetch_hint[0] = static_cast<int>(kept);
  evospec_vnni::g_prefetch_hint[1] = static_cast<int>(streamed);
#endif
}

void set_prefetch_distance(int64_t kept, int64_t streamed) {
  for (int64_t d : {kept, streamed})
    TORCH_CHECK(d >= 64 && d <= 65536 && d % 64 == 0,
                "set_prefetch_distance: distances are multiples of 64 bytes in 64..65536, got ", kept, ", ", streamed);
#ifdef EVOSPEC_VNNI
  evospec_vnni::g_prefetch_distance[0] = kept;
  evospec_vnni::g_prefetch_distance[1] = streamed;
#endif
}

std::vector<int64_t> prefetch_distances() {
#ifdef EVOSPEC_VNNI
  return {evospec_vnni::g_prefetch_distance[0], evospec_vnni::g_prefetch_distance[1]};
#else
  return {2560, 2560};
#endif
}

std::vector<int64_t> prefetch_hints() {
#ifdef EVOSPEC_VNNI
  return {evospec_vnni::g_prefetch_hint[0], evospec_vnni::g_prefetch_hint[1]};
#else
  return {0, 3};
#endif
}

int64_t int4_block_rows() { return kRows; }  // activation rows one pass over a weight tile takes

std::string int4_isa() {  // which instruction set the int8-activation kernels use (vnni.h)
#ifdef EVOSPEC_VNNI
  return evospec_vnni::kIsa;
#else
  return "none";
#endif
}

at::Tensor int4_matmul(const at::Tensor& x, const at::Tensor& packed, bool stream) {
#ifndef EVOSPEC_VNNI
  TORCH_CHECK(false, "int4_matmul: this build has no int8-activation kernel (AVX2 or later; check int4_vnni() first)");
  return x;
#else
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_matmul: x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(), "int4_matmul: packed must be contiguous uint8 [N/16, K/32, 320]");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), groups = packed.size(1), n = tiles * kTile;
  TORCH_CHECK(k == groups * kGroup, "int4_matmul: x has ", k, " columns, the weight ", groups * kGroup);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto xc = x.contiguous();
  auto out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const auto act = evospec_vnni::quantize_rows(xc);
  const int8_t* const codes = act.codes;
  const float* const ascale = act.scale;
  const float* const asum = act.sum;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  void* op = out.data_ptr();
  // Threads split the output tiles; each thread runs every row block over its tiles.
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t last) {
    if (bf16)
      tile_range(wp, groups, first, last, codes, ascale, asum, m, k, static_cast<uint16_t*>(op), n, stream);
    else
      tile_range(wp, groups, first, last, codes, ascale, asum, m, k, static_cast<float*>(op), n, stream);
  });
  return out;
#endif
}

// The largest of v[0..c) (the first on a tie) and log(sum_j exp(v[j] - max)): 16 lanes of partial
// maxima and sums, so both loops vectorise without reassociating one accumulator.
std::pair<int64_t, float> top1_row(const float* v, int64_t c, float* log_norm) {
  constexpr int kLanes = 16;
  float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -std::numeric_limits<float>::infinity();
  const int64_t body = c - c % kLanes;
  for (int64_t i = 0; i < body; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane_max[l] = v[i + l] > lane_max[l] ? v[i + l] : lane_max[l];
  float mx = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) mx = lane_max[l] > mx ? lane_max[l] : mx;
  for (int64_t i = body; i < c; ++i) mx = v[i] > mx ? v[i] : mx;
  int64_t arg = 0;
  while (arg < c && !(v[arg] == mx)) ++arg;
  float lane_sum[kLanes] = {};
  for (int64_t i = 0; i < body; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lane_sum[l] += evospec_fastexp::exp_f32(v[i + l] - mx);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lane_sum[l];
  for (int64_t i = body; i < c; ++i) sum += evospec_fastexp::exp_f32(v[i] - mx);
  *log_norm = std::log(sum);
  return {arg, mx};
}

std::tuple<at::Tensor, at::Tensor> int4_top1(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias,
                                             const at::Tensor& ids) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_top1: x must be float32 [M, K]");
  const int64_t c = bias.numel();
  TORCH_CHECK(bias.dim() == 1 && bias.scalar_type() == at::kFloat && bias.is_contiguous() && c >= 1,
              "int4_top1: bias must be contiguous float32 [C], C >= 1");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.numel() == c && ids.is_contiguous(),
              "int4_top1: ids must be contiguous int64 [C]");
  auto logits = int4_matmul(x, packed, false);  // [M, C16]
  TORCH_CHECK(logits.size(1) >= c, "int4_top1: the weight has ", logits.size(1), " outputs, the bias ", c);
  const int64_t m = logits.size(0), width = logits.size(1);
  auto logp = at::empty({m, 1}, x.options());
  auto top = at::empty({m, 1}, ids.options());
  float* lp = logits.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) {
    float* row = lp + r * width;
    for (int64_t j = 0; j < c; ++j) row[j] += bp[j];
    float log_norm = 0.0f;
    const auto [arg, mx] = top1_row(row, c, &log_norm);
    TORCH_CHECK(std::isfinite(mx) && arg < c, "int4_top1: row ", r, " has no finite output");
    logp.data_ptr<float>()[r] = -log_norm;  // (mx - mx) - log(sum exp(v - mx))
    top.data_ptr<int64_t>()[r] = ids.data_ptr<int64_t>()[arg];
  }
  return {logp, top};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evospec, m) {
  m.def("int4_vnni() -> bool", &int4_vnni);
  m.def("int4_isa() -> str", &int4_isa);
  m.def("int4_block_rows() -> int", &int4_block_rows);
  m.def("set_prefetch(int kept, int streamed) -> ()", &set_prefetch);
  m.def("prefetch_hints() -> int[]", &prefetch_hints);
  m.def("set_prefetch_distance(int kept, int streamed) -> ()", &set_prefetch_distance);
  m.def("prefetch_distances() -> int[]", &prefetch_distances);
  m.def("int4_matmul(Tensor x, Tensor packed, bool stream=False) -> Tensor");
  m.def("int4_top1(Tensor x, Tensor packed, Tensor bias, Tensor ids) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evospec, CPU, m) {
  m.impl("int4_matmul", &int4_matmul);
  m.impl("int4_top1", &int4_top1);
}

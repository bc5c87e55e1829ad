// How the threads of llama_layer.cpp's parallel regions share a phase's work and meet between
// phases: contiguous shares, rows cut into column pieces, and a spinning barrier.
//
// Why a barrier of our own: a decode step of SmolLM2 crosses ~300 of them (10 a layer), and
// after the last thread arrives, libgomp's `omp barrier` took ~1,000 cycles to let the team go
// (phase timings in a one-row step on a 2-core Zen 4 guest, wave 41); this one ~50. Its waiters
// spin, then yield the core after ~0.1 ms, so an oversubscribed machine still makes progress.
//
// Why rows in pieces: a one-token step has one row, and its elementwise phases (RoPE, the
// attention output's and the MLP activation's codes) ran on one thread while the others waited.
// Cut into heads or 32-wide column groups (the activation codes' groups), every thread takes a
// share, and each element and group is computed by the same code as before: the same bits. (The
// norms' phases stay whole rows: a norm reads its whole row, and computing that part on every
// thread cost more than it saved.)
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sched.h>

namespace evospec_team {

struct Span {
  int64_t first, last;
};

// Thread tid's part of [0, total): `team` contiguous parts of near-equal size.
inline Span share(int64_t total, int tid, int team) {
  const int64_t per = total / team, extra = total % team;
  const int64_t first = tid * per + std::min<int64_t>(tid, extra);
  return {first, first + per + (tid < extra ? 1 : 0)};
}

// Thread tid's share of m rows of `per` units each (heads, column groups), as one call of
// f(row, first unit, last unit) per row it touches: rows in order, units contiguous.
template <typename F>
inline void row_pieces(int64_t m, int64_t per, int tid, int team, F&& f) {
  const Span s = share(m * per, tid, team);
  for (int64_t u = s.first; u < s.last;) {
    const int64_t r = u / per, lo = u % per, hi = std::min(per, lo + (s.last - u));
    f(r, lo, hi);
    u += hi - lo;
  }
}

// A barrier for the `n` threads of one parallel region (set n before they first wait).
struct alignas(64) Barrier {
  std::atomic<int> count{0};
  alignas(64) std::atomic<int> generation{0};
  int n = 1;

  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == n - 1) {  // the last to arrive
      count.store(0, std::memory_order_relaxed);
      generation.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation.load(std::memory_order_acquire) == gen; ++spins) {
      if (spins < kSpins) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        sched_yield();
      }
    }
  }

 private:
  static constexpr int kSpins = 2048;  // PAUSEs before yielding: ~0.05-0.1 ms
};

}  // namespace evospec_team

// The Q4_1 GEMM's 32-column tile (kern_avx512.h tile2_q4_1_vnni: one activation broadcast feeds two 16-column
// tiles) against two calls of the 16-column tile (tile_q4_1_vnni), the way mm_core.h's mm_act chunks rows for
// each (<= 16 rows a call for the single tile, <= kPairRows for the pair, evened out), on cache-resident
// weights (96 tiles x K = 576: 553 KB, in L2), one thread, thread CPU time, the two interleaved per repetition
// (min of 40). Checks that both give the same bits. AVX-512 VNNI machines only:
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc benchmarks/tile_pair.cpp -o /tmp/tile_pair
//   /tmp/tile_pair
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "treedraft/kernels/kern_avx512.h"
#include "thread_clock.h"

using namespace td;

int main() {
#if !defined(__AVX512VNNI__)
  std::printf("needs AVX-512 VNNI (the 32-column tile)\n");
  return 0;
#else
  const int K = 576, T = 96, B = K / kQK;
  const int64_t tile_bytes = (int64_t)B * kQ41Bytes;
  std::mt19937 g(1);
  std::vector<uint8_t> w(T * tile_bytes);
  for (auto& v : w) v = (uint8_t)g();
  for (int t = 0; t < T * B; t++) {  // sane fp16 scales and mins
    uint16_t* d = (uint16_t*)(w.data() + (int64_t)t * kQ41Bytes + 256);
    for (int i = 0; i < 32; i++) d[i] = (uint16_t)(0x2000 + (g() & 0xff));
  }
  g_prefetch_ahead = 0;  // cache-resident: no streaming to prefetch
  std::printf("ns per (row, 16-column tile, 32-k block), min of 40\n| rows | 16-column tile | 32-column tile | ratio |\n"
              "|---|---|---|---|\n");
  for (int M : {1, 2, 3, 4, 6, 8, 12, 16}) {
    std::vector<int8_t> q(M * K);
    std::vector<float> d(M * B), s(M * B), out[2] = {std::vector<float>(M * T * 16), std::vector<float>(M * T * 16)};
    for (auto& x : q) x = (int8_t)((int)(g() % 255) - 127);
    for (auto& x : d) x = 0.01f * (1 + g() % 7);
    for (auto& x : s) x = 0.1f * (1 + g() % 5);
    Act a;
    a.M = M, a.K = K, a.B = B, a.q = q.data(), a.d = d.data(), a.s = s.data();
    const int n1 = (M + kRowBlockAvx512 - 1) / kRowBlockAvx512, rb1 = (M + n1 - 1) / n1;
    const int n2 = (M + kPairRows - 1) / kPairRows, rb2 = (M + n2 - 1) / n2;
    double best[2] = {1e9, 1e9};
    for (int rep = 0; rep < 40; ++rep)
      for (int var = 0; var < 2; ++var) {
        const double t0 = thread_seconds();
        for (int it = 0; it < 10; ++it)
          for (int t = 0; t < T; t += 2) {
            const uint8_t* wt = w.data() + t * tile_bytes;
            float* o = out[var].data() + t * 16;
            if (var == 0)
              for (int r = 0; r < M; r += rb1) {
                tile_q4_1_vnni(wt, a, r, std::min(rb1, M - r), o, T * 16, 16);
                tile_q4_1_vnni(wt + tile_bytes, a, r, std::min(rb1, M - r), o + 16, T * 16, 16);
              }
            else
              for (int r = 0; r < M; r += rb2) tile2_q4_1_vnni(wt, a, r, std::min(rb2, M - r), o, T * 16, 32);
          }
        best[var] = std::min(best[var], thread_seconds() - t0);
      }
    const double per = 10.0 * T * B * M;
    std::printf("| %d | %.2f | %.2f | %.2fx |%s\n", M, best[0] / per * 1e9, best[1] / per * 1e9, best[0] / best[1],
                std::memcmp(out[0].data(), out[1].data(), out[0].size() * 4) ? " BITS DIFFER" : "");
  }
  return 0;
#endif
}

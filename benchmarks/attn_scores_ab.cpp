// The block-GEMM attention's pass 1 (kernels/attn_gemm.h gemm_scores) on an fp16 KV cache, A/B on the calling
// thread's CPU time, old and new interleaved per repetition: old = keys widened per query pair as they are read
// (gemm_scores_rows on fp16), new = each 16-key chunk widened to float32 once (gemm_scores_widened; gemm_scores
// takes it from kWidenMinQ queries on). 90 kv-head slabs of 512 keys (SmolLM2-135M's 30 layers x 3 kv heads,
// hd 64), nq = queries of one kv head (3 per tree row). Every variant's scores are checked to be the same bits.
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc/treedraft/kernels
//       benchmarks/attn_scores_ab.cpp -o /tmp/attn_scores_ab && /tmp/attn_scores_ab [reps]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "attn.h"
#include "thread_clock.h"

using namespace td::attn;

int main(int argc, char** argv) {
#if !defined(__AVX512F__)
  std::printf("needs an AVX-512 build (the block-GEMM path)\n");
  return 0;
#else
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20, hd = 64, L = 512, slabs = 90;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<half_t> kh((size_t)slabs * L * hd), vh(kh.size());
  for (size_t i = 0; i < kh.size(); ++i) kh[i] = f32_to_half(3 * nd(rng)), vh[i] = f32_to_half(nd(rng));
  static float s[2][(kGemmMaxQ + 15) * kGemmMaxKeys];
  std::printf("thread CPU ms of pass 1 over %d slabs x %d keys (best of %d)\n| nq | old | new | old/new |\n"
              "|---|---|---|---|\n", slabs, L, reps);
  for (int nq : {6, 12, 15, 18, 21, 24, 36, 48}) {
    std::vector<float> qv(nq * hd);
    for (float& x : qv) x = nd(rng);
    std::vector<const float*> q(nq);
    for (int i = 0; i < nq; ++i) q[i] = &qv[i * hd];
    double best[2] = {1e9, 1e9};
    bool same = true;
    for (int r = 0; r < reps; ++r)
      for (int var = 0; var < 2; ++var) {
        const double t0 = thread_seconds();
        for (int sl = 0; sl < slabs; ++sl)
          for (int b = 0; b < L / kGemmMaxKeys; ++b) {
            const size_t o = ((size_t)sl * L + (size_t)b * kGemmMaxKeys) * hd;
            if (var == 0)
              gemm_scores_rows<4>(nq, q.data(), &kh[o], hd, &vh[o], hd, kGemmMaxKeys, 0.125f, s[0], true);
            else
              gemm_scores_widened<4>(nq, q.data(), &kh[o], hd, &vh[o], hd, kGemmMaxKeys, 0.125f, s[1]);
          }
        best[var] = std::min(best[var], thread_seconds() - t0);
        if (var == 1)  // the last block of both: every query's row
          for (int u = 0; u < nq; ++u) same &= !std::memcmp(s[0] + u * kGemmMaxKeys, s[1] + u * kGemmMaxKeys, 512);
      }
    std::printf("| %d | %.2f | %.2f | %.2fx |%s\n", nq, best[0] * 1e3, best[1] * 1e3, best[0] / best[1],
                same ? "" : " BITS DIFFER");
  }
  return 0;
#endif
}

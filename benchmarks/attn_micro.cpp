// Decode attention kernels alone (kernels/attn.h attend_block), A/B on the calling thread's CPU time, so
// other processes on a shared machine do not count. Keys/values of 90 kv-head slabs of 512 keys (30 layers
// x 3 kv heads of SmolLM2-135M, hd 64: 23.6 MB in float32, more than the caches) are walked once per
// repetition, as a decode step streams them; nq = queries of one kv head (3 per row: GQA 9 over 3).
// For each nq: the block-GEMM passes off vs on (float32 KV), and float32 vs float16 KV (GEMM on);
// every pair is checked to give the same bits (float16 against float32 holding the rounded values).
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc/treedraft/kernels
//       benchmarks/attn_micro.cpp -o /tmp/attn_micro && /tmp/attn_micro [reps]
#include <cstdio>
#include <cstdlib>
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
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20, hd = 64, L = 512, slabs = 90, nb = num_blocks(L);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<half_t> kh((size_t)slabs * L * hd), vh(kh.size());
  std::vector<float> kf(kh.size()), vf(kh.size());
  for (size_t i = 0; i < kh.size(); ++i) {
    kh[i] = f32_to_half(3 * nd(rng)), vh[i] = f32_to_half(nd(rng));
    kf[i] = to_f32(kh[i]), vf[i] = to_f32(vh[i]);
  }
  std::printf("thread CPU ms per pass over %d slabs x %d keys (best of %d), old/new ratio\n", slabs, L, reps);
  std::printf("| nq | gemm off | gemm on | off/on | fp32 KV | fp16 KV | fp32/fp16 |\n|---|---|---|---|---|---|---|\n");
  for (int nq : {3, 6, 12, 48}) {
    std::vector<float> qv(nq * hd), st(nq * nb * state_size(hd));
    for (float& x : qv) x = nd(rng);
    std::vector<const float*> q(nq);
    std::vector<const int32_t*> idx(nq, nullptr);
    std::vector<int> n(nq, L), shared(nq, L);
    std::vector<float*> sp(nq);
    for (int i = 0; i < nq; ++i) q[i] = &qv[i * hd];
    // variant 0: fp32 gemm off, 1: fp32 gemm on, 2: fp16 gemm on
    double best[3] = {1e9, 1e9, 1e9};
    std::vector<float> out[3];
    for (int r = 0; r < reps; ++r)
      for (int var = 0; var < 3; ++var) {
        g_block_gemm = var > 0;
        const double t0 = thread_seconds();
        for (int s = 0; s < slabs; ++s)
          for (int b = 0; b < nb; ++b) {
            for (int i = 0; i < nq; ++i) sp[i] = &st[(i * nb + b) * state_size(hd)];
            const size_t o = (size_t)s * L * hd;
            if (var < 2)
              attend_block<kAvx512>(nq, q.data(), idx.data(), n.data(), shared.data(), &kf[o], hd, &vf[o], hd, hd,
                                    0.125f, b, sp.data());
            else
              attend_block<kAvx512>(nq, q.data(), idx.data(), n.data(), shared.data(), &kh[o], hd, &vh[o], hd, hd,
                                    0.125f, b, sp.data());
          }
        best[var] = std::min(best[var], thread_seconds() - t0);
        out[var] = st;
      }
    g_block_gemm = true;
    const bool same = out[0] == out[1] && out[1] == out[2];
    std::printf("| %d | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2fx |%s\n", nq, best[0] * 1e3, best[1] * 1e3,
                best[0] / best[1], best[1] * 1e3, best[2] * 1e3, best[1] / best[2], same ? "" : " BITS DIFFER");
  }
  return 0;
#endif
}

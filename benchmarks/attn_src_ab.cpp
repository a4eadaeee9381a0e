// Decode attention of two copies of the kernel sources side by side in one process (thread CPU time,
// min / median of interleaved reps, and a bitwise check), e.g. a commit's kernels against this tree's.
// Keys/values: 90 kv-head slabs of 512 keys, hd 64 (30 layers x 3 kv heads of SmolLM2-135M: 23.6 MB in
// float32, more than the caches), walked once per rep ("stream") or one slab 90 times ("cached": the
// compute alone); nq = queries per kv head (3 = one row's GQA group). ISA: kAvx512, kAvx2 or kScalar.
//
//   git archive <rev> src/treedraft/kernels | tar -x -C /tmp/base
//   C="g++ -O3 -march=native -ffp-contract=off -std=c++17"
//   $C -c -DISA=kAvx512 -DVNAME=run_a -Dtd=td_a -I/tmp/base/src/treedraft/kernels benchmarks/attn_src_ab.cpp -o /tmp/a.o
//   $C -c -DISA=kAvx512 -DVNAME=run_b -Dtd=td_b -Isrc/treedraft/kernels benchmarks/attn_src_ab.cpp -o /tmp/b.o
//   $C benchmarks/attn_src_ab.cpp /tmp/a.o /tmp/b.o -o /tmp/attn_src_ab && /tmp/attn_src_ab [reps]
// (-Dtd=... renames the kernels' namespace so both copies link into one binary.)
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#if defined(VNAME)  // one copy of the kernels
#include "attn.h"
using namespace td::attn;

static double thread_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

template <class T>
static double pass(int slabs, int nq, const T* k, const T* v, const float* qv, std::vector<float>& st) {
  const int hd = 64, L = 512, nb = num_blocks(L);
  st.assign((size_t)nq * nb * state_size(hd), 0.f);
  std::vector<const float*> q(nq);
  std::vector<const int32_t*> idx(nq, nullptr);
  std::vector<int> n(nq, L), shared(nq, L);
  std::vector<float*> sp(nq);
  for (int i = 0; i < nq; ++i) q[i] = qv + i * hd;
  const double t0 = thread_ms();
  for (int s = 0; s < 90; ++s) {
    const size_t o = (size_t)(s % slabs) * L * hd;
    for (int b = 0; b < nb; ++b) {
      for (int i = 0; i < nq; ++i) sp[i] = &st[(size_t)(i * nb + b) * state_size(hd)];
      attend_block<ISA>(nq, q.data(), idx.data(), n.data(), shared.data(), k + o, hd, v + o, hd, hd, 0.125f, b,
                        sp.data());
    }
  }
  return thread_ms() - t0;
}

double VNAME(bool half, int slabs, int nq, const void* k, const void* v, const float* q, std::vector<float>& st) {
  return half ? pass(slabs, nq, (const half_t*)k, (const half_t*)v, q, st)
              : pass(slabs, nq, (const float*)k, (const float*)v, q, st);
}

#else  // the driver
#include <immintrin.h>

double run_a(bool, int, int, const void*, const void*, const float*, std::vector<float>&);
double run_b(bool, int, int, const void*, const void*, const float*, std::vector<float>&);

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 15, hd = 64, L = 512, slabs = 90;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> kh((size_t)slabs * L * hd), vh(kh.size());
  std::vector<float> kf(kh.size()), vf(kh.size()), q(64 * hd);
  for (size_t i = 0; i < kh.size(); ++i) {
    kh[i] = _cvtss_sh(3 * nd(rng), 0), vh[i] = _cvtss_sh(nd(rng), 0);
    kf[i] = _cvtsh_ss(kh[i]), vf[i] = _cvtsh_ss(vh[i]);
  }
  for (float& x : q) x = nd(rng);
  std::printf("thread ms per pass over 90 slabs x 512 keys, %d interleaved reps\n", reps);
  std::printf("| nq | KV | data | a min / median | b min / median | a/b (min) | bits |\n|---|---|---|---|---|---|---|\n");
  for (int nq : {1, 3, 6})
    for (int half : {0, 1})
      for (int sl : {slabs, 1}) {
        std::vector<double> a, b;
        std::vector<float> sa, sb;
        bool same = true;
        const void* k = half ? (const void*)kh.data() : kf.data();
        const void* v = half ? (const void*)vh.data() : vf.data();
        for (int r = 0; r < reps; ++r) {
          a.push_back(run_a(half, sl, nq, k, v, q.data(), sa));
          b.push_back(run_b(half, sl, nq, k, v, q.data(), sb));
          same = same && sa == sb;
        }
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        std::printf("| %d | %s | %s | %.2f / %.2f | %.2f / %.2f | %.2fx | %s |\n", nq, half ? "fp16" : "fp32",
                    sl == 1 ? "cached" : "stream", a[0], a[reps / 2], b[0], b[reps / 2], a[0] / b[0],
                    same ? "equal" : "DIFFER");
      }
  return 0;
}
#endif

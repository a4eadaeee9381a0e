// One decode step's attention (30 layers of SmolLM2-135M shapes: 9 heads over 3 kv heads, hd 64) through the
// same scheduler and pool as the fused decoder (attn_sched.h Runner + pool.h), to profile where a layer's
// attention time goes. Between layers a 3.2 MB buffer is streamed through the pool like a layer's weights,
// so each layer's keys/values come from memory as in a real step ("cold"); --hot keeps one layer's cache
// and repeats it (the compute alone). Rows: 1 (the plain step, causal over context + 1 keys) or a binary
// tree of T rows over one shared prefix (parent of i is (i - 1) / 2). Prints the median / min per step and
// per layer over the repetitions, by the calling thread's CPU time (--clock thread, default: other
// processes on a shared machine barely count; with --threads 2 use --clock wall on a quiet machine).
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc/treedraft/kernels -pthread
//       benchmarks/attn_step_micro.cpp -o /tmp/attn_step && /tmp/attn_step --rows 1 --kv fp16
//   options: --threads N  --rows T  --kv fp32|fp16  --reps R  --hot  --clock thread|wall  --context L
//   (add -DTD_NO_PREFETCH to the build to see what the software prefetch is worth)
//
// Session 8, Xeon Skylake-SP, load ~5, 1 thread, CPU time, 1 row: fp32 3.2-3.5 ms (7.0 GB/s of KV), fp16
// 2.0-2.2 ms; --hot 53 / 47 us per layer; TD_NO_PREFETCH 4.16 / 2.48 ms (benchmarks/results/attn8.md).
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn.h"
#include "attn_sched.h"
#include "pool.h"

using namespace td;
using namespace td::attn;

static bool g_thread_clock = true;
static double now() {
  if (g_thread_clock) {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  int threads = 1, rows = 1, reps = 20, ctx = 512;
  bool half = false, hot = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--threads") threads = std::atoi(next().c_str());
    else if (a == "--rows") rows = std::atoi(next().c_str());
    else if (a == "--reps") reps = std::atoi(next().c_str());
    else if (a == "--context") ctx = std::atoi(next().c_str());
    else if (a == "--kv") half = next() == "fp16";
    else if (a == "--clock") g_thread_clock = next() == "thread";
    else if (a == "--hot") hot = true;
    else return std::printf("unknown option %s\n", a.c_str()), 2;
  }
#if defined(__AVX512F__)
  constexpr Isa isa = kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  constexpr Isa isa = kAvx2;  // e.g. built with -march=znver3: the AVX2 paths as an AVX2-only CPU runs them
#else
  constexpr Isa isa = kScalar;
  std::printf("needs an AVX-512 or AVX2 build\n");
  return 0;
#endif
  const int nl = hot ? 1 : 30, nkv = 3, nh = 9, hd = 64, cap = ctx + 128, T = rows;
  Pool pool(threads, 100);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<std::vector<float>> kf(nl), vf(nl);
  std::vector<std::vector<half_t>> kh(nl), vh(nl);
  for (int l = 0; l < nl; ++l)
    for (size_t i = 0; i < (size_t)nkv * cap * hd; ++i) {
      kh[l].push_back(f32_to_half(nd(rng))), vh[l].push_back(f32_to_half(nd(rng)));
      kf[l].push_back(to_f32(kh[l].back())), vf[l].push_back(to_f32(vh[l].back()));
    }
  std::vector<float> q(T * nh * hd), out(T * nh * hd);
  for (float& x : q) x = nd(rng);
  std::vector<int32_t> idx;  // tree row t: the prefix, then its ancestors and itself (slots ctx + node)
  std::vector<int> off(T), cnt(T), shared(T);
  for (int t = 0; t < T; ++t) {
    off[t] = (int)idx.size();
    for (int s = 0; s < ctx; ++s) idx.push_back(s);
    std::vector<int> path;
    for (int a = t;; a = (a - 1) / 2) {
      path.push_back(a);
      if (a == 0) break;
    }
    std::sort(path.begin(), path.end());
    for (int a : path) idx.push_back(ctx + a);
    cnt[t] = (int)idx.size() - off[t];
    int c = 0;  // leading ranks that are the slots 0, 1, ... (as fused.h computes them)
    while (c < cnt[t] && idx[off[t] + c] == c) ++c;
    shared[t] = c;
  }
  std::vector<uint8_t> weights(96u << 20, 1);
  size_t wpos = 0;
  std::atomic<uint64_t> sink{0};
  Runner runner;
  std::vector<Query> qs;
  std::vector<Group> gs;
  std::vector<double> per;
  std::vector<float> first;
  for (int r = 0; r < reps; ++r) {
    double tot = 0;
    for (int l = 0; l < nl; ++l) {
      if (!hot) {  // a layer's weights through the pool: evicts this layer's keys/values as a real step does
        const size_t n = 3200000;
        pool.run(
            [&](int u) {
              uint64_t acc = 0;
              const uint64_t* p = (const uint64_t*)(weights.data() + wpos + u * (n / 16));
              for (size_t i = 0; i < n / 16 / 8; i += 8) acc += p[i];
              sink += acc;
            },
            16);
        wpos = (wpos + n) % (weights.size() - n);
      }
      qs.clear(), gs.clear();
      for (int g = 0; g < nkv; ++g) {
        const int q0 = (int)qs.size();
        for (int t = 0; t < T; ++t)
          for (int h = g * (nh / nkv); h < (g + 1) * (nh / nkv); ++h)
            qs.push_back({&q[(t * nh + h) * hd], T == 1 ? nullptr : idx.data() + off[t], T == 1 ? ctx + 1 : cnt[t],
                          T == 1 ? ctx + 1 : shared[t], &out[(t * nh + h) * hd]});
        const size_t o = (size_t)g * cap * hd;
        if (half) gs.push_back({kh[l].data() + o, vh[l].data() + o, hd, hd, q0, (int)qs.size(), true});
        else gs.push_back({kf[l].data() + o, vf[l].data() + o, hd, hd, q0, (int)qs.size(), false});
      }
      const double t0 = now();
      runner.run(isa, gs, qs, hd, 0.125f, pool);
      tot += now() - t0;
    }
    if (r == 0) first = out;
    else if (first != out) std::printf("outputs changed between repetitions\n");
    per.push_back(tot);
  }
  std::sort(per.begin(), per.end());
  const double med = per[per.size() / 2], mn = per[0];
  std::printf("%d thread(s), %s KV, %d row(s), context %d%s: %.3f / %.3f ms per step (median / min), %.1f / %.1f us "
              "per layer (%s clock)\n",
              threads, half ? "fp16" : "fp32", T, ctx, hot ? ", hot (1 layer repeated)" : "", med * 1e3, mn * 1e3,
              med * 1e6 / nl, mn * 1e6 / nl, g_thread_clock ? "thread" : "wall");
  return sink == 42 ? 1 : 0;  // keeps the stream
}

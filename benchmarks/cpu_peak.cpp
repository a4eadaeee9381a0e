// This CPU's register-only peaks for the two instructions the kernels lean on: vpdpbusd (int8 dot products,
// the Q4_1 / Q8_0 GEMM tiles) and vfmadd231ps (fp32 FMA, attention) on zmm registers, 24 independent
// accumulators (no loads or stores in the loop), per thread. Run two copies at once to see both cores.
// AVX-512 VNNI machines only. Build and run:
//   g++ -O3 -march=native -o /tmp/cpu_peak benchmarks/cpu_peak.cpp && /tmp/cpu_peak
//   /tmp/cpu_peak & /tmp/cpu_peak; wait
// Session 12 (Zen 5 EPYC VM, quiet): fp32 ~115 G FMA/s per thread (7.2 zmm FMAs per ns), int8 vpdpbusd
// 175-225 G MAC/s per thread (2.7-3.5 zmm per ns), alone or two at once.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  __m512i acc[24];
  __m512 f[24];
  for (int i = 0; i < 24; ++i) {
    acc[i] = _mm512_set1_epi32(i);
    f[i] = _mm512_set1_ps((float)i);
  }
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const long N = 100000000;
  for (int rep = 0; rep < 2; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < N; ++n) {
      _Pragma("GCC unroll 24") for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    long sink = 0;
    for (int i = 0; i < 24; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
    std::printf("vpdpbusd zmm: %.1f G int8 MAC/s (%.2f instr/ns) [%ld]\n", N * 24.0 * 64 / s / 1e9, N * 24.0 / s / 1e9,
                sink);
    t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < N; ++n) {
      _Pragma("GCC unroll 24") for (int i = 0; i < 24; ++i) f[i] = _mm512_fmadd_ps(f[i], x, y);
    }
    s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float fs = 0;
    for (int i = 0; i < 24; ++i) fs += _mm512_reduce_add_ps(f[i]);
    std::printf("vfmadd231ps zmm: %.1f G fp32 FMA/s (%.2f instr/ns) [%g]\n", N * 24.0 * 16 / s / 1e9, N * 24.0 / s / 1e9,
                fs);
  }
}

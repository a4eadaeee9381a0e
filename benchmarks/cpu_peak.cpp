// This CPU's register-only peaks for the two instructions the kernels lean on: vpdpbusd (int8 dot products,
// the Q4_1 / Q8_0 GEMM tiles) and vfmadd231ps (fp32 FMA, attention) on zmm registers, per thread; plus the
// tile kernel's own instruction mix (16 rows x 8 vpdpbusd per weight block, 8 weight registers, activations
// broadcast from memory) with no weight streaming. Each measurement runs in its own function with 16
// independent accumulators, so nothing spills (session 12's version kept 24 int and 24 float accumulators
// live in one function: 48 zmm > 32, spilled in the loop, and read vpdpbusd at about half its rate).
// AVX-512 VNNI machines only. Build and run:
//   g++ -O3 -march=native -o /tmp/cpu_peak benchmarks/cpu_peak.cpp && /tmp/cpu_peak
//   /tmp/cpu_peak & /tmp/cpu_peak; wait          # both cores at once
// Session 13 (Zen 4 EPYC VM, 2.6 GHz nominal): vpdpbusd 2.6-3.1 zmm per ns (165-200 G int8 MAC/s per thread) in
// both forms; vfmadd231ps 3.3-3.6 zmm per ns (53-58 G FMA/s).
// Where the CPU has AVX512_BF16 it also times vdpbf16ps (bf16 pair dot products into fp32: the instruction a bf16
// attention would use). Session 20, same Zen 4: vpdpbusd 3.3-3.5 zmm per ns (212-224 G MAC/s per thread, both
// cores busy), vfmadd231ps 3.5-3.6 (55-58 G FMA/s), vdpbf16ps 3.6 (115 G bf16 MAC/s: twice fp32 FMA's MACs).
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstring>

static const long kIters = 20000000;

static double secs_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

__attribute__((noinline)) static void dpbusd_registers() {
  __m512i acc[16], w[8], x[8];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  for (int i = 0; i < 8; ++i) w[i] = _mm512_set1_epi8((char)(3 + i)), x[i] = _mm512_set1_epi8((char)(5 - i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    _Pragma("GCC unroll 16") for (int r = 0; r < 16; ++r) {
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) acc[r] = _mm512_dpbusd_epi32(acc[r], w[i], x[(i + r) & 7]);
    }
  }
  const double s = secs_since(t0);
  long sink = 0;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  std::printf("vpdpbusd zmm, register sources: %.1f G int8 MAC/s (%.2f instr/ns) [%ld]\n",
              kIters * 128.0 * 64 / s / 1e9, kIters * 128.0 / s / 1e9, sink);
}

__attribute__((noinline)) static void dpbusd_tile_mix(const signed char* xa) {
  __m512i acc[16], w[8];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  for (int i = 0; i < 8; ++i) w[i] = _mm512_set1_epi8((char)(3 + i));
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters; ++n) {
    const signed char* xb = xa + (n & 7) * 4;
    _Pragma("GCC unroll 16") for (int r = 0; r < 16; ++r) {
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
        int v;
        std::memcpy(&v, xb + 32 * r + 4 * i, 4);
        acc[r] = _mm512_dpbusd_epi32(acc[r], w[i], _mm512_set1_epi32(v));
      }
    }
  }
  const double s = secs_since(t0);
  long sink = 0;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  std::printf("vpdpbusd zmm, tile mix (memory broadcasts): %.1f G int8 MAC/s (%.2f instr/ns) [%ld]\n",
              kIters * 128.0 * 64 / s / 1e9, kIters * 128.0 / s / 1e9, sink);
}

__attribute__((noinline)) static void fma_registers() {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_set1_ps((float)i);
  const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters * 8; ++n) {
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) f[i] = _mm512_fmadd_ps(f[i], x, y);
  }
  const double s = secs_since(t0);
  float fs = 0;
  for (int i = 0; i < 16; ++i) fs += _mm512_reduce_add_ps(f[i]);
  std::printf("vfmadd231ps zmm: %.1f G fp32 FMA/s (%.2f instr/ns) [%g]\n", kIters * 128.0 * 16 / s / 1e9,
              kIters * 128.0 / s / 1e9, fs);
}

#if defined(__AVX512BF16__)
__attribute__((noinline)) static void dpbf16_registers() {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_set1_ps((float)i);
  __m512bh a[4], b[4];
  for (int i = 0; i < 4; ++i) {  // bf16 1.0 + i ulp and 0.5 + i ulp, as raw bits
    a[i] = (__m512bh)_mm512_set1_epi16((short)(0x3f80 + i));
    b[i] = (__m512bh)_mm512_set1_epi16((short)(0x3f00 + i));
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < kIters * 8; ++n) {
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) f[i] = _mm512_dpbf16_ps(f[i], a[i & 3], b[i >> 2]);
  }
  const double s = secs_since(t0);
  float fs = 0;
  for (int i = 0; i < 16; ++i) fs += _mm512_reduce_add_ps(f[i]);
  std::printf("vdpbf16ps zmm: %.1f G bf16 MAC/s (%.2f instr/ns) [%g]\n", kIters * 128.0 * 32 / s / 1e9,
              kIters * 128.0 / s / 1e9, fs);
}
#endif

int main() {
  alignas(64) static signed char xa[64 * 16];
  for (int i = 0; i < 64 * 16; ++i) xa[i] = (signed char)(i * 7);
  for (int rep = 0; rep < 2; ++rep) {
    dpbusd_registers();
    dpbusd_tile_mix(xa);
    fma_registers();
#if defined(__AVX512BF16__)
    dpbf16_registers();
#endif
  }
}

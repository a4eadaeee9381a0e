// The quantized GEMM's driver: code-path table, thread pool, activation quantization and mm_into
// (x @ W^T into a caller-owned buffer). Included by qgemm.cpp; one translation unit.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "common.h"
#include "kern_avx2.h"
#include "kern_avx512.h"
#include "kern_scalar.h"
#include "pool.h"

namespace td {

enum Kind { kQ4_1 = 0, kQ8_0 = 1 };

struct Path {
  const char* name;
  TileFn q4_1;
  TileFn q8_0;
  int row_block;
};

inline std::vector<Path> compiled_paths() {
  std::vector<Path> p;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  p.push_back({"avx512", tile_q4_1_avx512, tile_q8_0_avx512, kRowBlockAvx512});
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  p.push_back({"avx2", tile_q4_1_avx2, tile_q8_0_avx2, kRowBlockAvx2});
#endif
  p.push_back({"scalar", tile_q4_1_scalar, tile_q8_0_scalar, 4});
  return p;
}

inline int g_threads = 1;
// Profiling only (FusedDecoder.set_profile): wall time mm_into spends quantizing activations, in ns.
inline bool g_time_quant = false;
inline int64_t g_quant_ns = 0;
inline int g_spin_us = 100;
inline std::unique_ptr<Pool> g_pool;

inline Pool& pool() {
  if (g_pool && g_pool->pid() != getpid()) {
    (void)g_pool.release();  // forked child: the parent's threads do not exist here; leak it
  }
  if (!g_pool || g_pool->size() != g_threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(g_threads, g_spin_us);
  }
  return *g_pool;
}

// Quantize one row's block of 32 floats. Identical arithmetic on every path (IEEE division,
// multiply, round-to-nearest-even), so a row's codes never depend on the path or the batch.
inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out) {
#if defined(__AVX512F__)
  const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
  const float amax =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.f);
  const __m512 r0 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a0, vid),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  const __m512 r1 = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(a1, vid),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
  const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(i1));
  const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
  float amax = 0.f;
  for (int k = 0; k < kQK; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int k = 0; k < kQK; ++k) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[k] * id)));
    q[k] = (int8_t)v;
    sum += (int)v;
  }
#endif
  *d_out = d;
  *s_out = d * (float)sum;
}

struct ActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

// Validate the call; returns the tile function of the requested path.
inline const Path& pick_path(const std::string& name) {
  static const std::vector<Path> paths = compiled_paths();
  if (name.empty()) return paths.front();
  for (const auto& p : paths)
    if (name == p.name) return p;
  TORCH_CHECK(false, "treedraft qgemm: unknown or uncompiled path '", name, "'");
}


// y (M, N) row-major = x (M, K) row-major @ W^T for a packed weight wp of `kind`; no checks (the
// callers validate shapes). Shared by the Python-facing mm and the fused decoder (fused.h).
inline void mm_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int kind,
                    const Path& path, float* yp) {
  if (M == 0 || N == 0) return;
  const int64_t T = (N + kTile - 1) / kTile, B = K / kQK;
  const int64_t blk = kind == kQ4_1 ? kQ41Bytes : kQ80Bytes;
  thread_local ActBuf buf;
  const auto tq0 = g_time_quant ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  buf.q.resize(M * K);
  buf.d.resize(M * B);
  buf.s.resize(M * B);
  // block-major (B, M, 32) codes so a kernel finds the rows of one block at constant offsets
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b)
      quantize_block(xp + m * K + b * kQK, buf.q.data() + (b * M + m) * kQK,
                     buf.d.data() + b * M + m, buf.s.data() + b * M + m);
  Act a;
  a.M = (int)M;
  a.K = (int)K;
  a.B = (int)B;
  a.q = buf.q.data();
  a.d = buf.d.data();
  a.s = buf.s.data();
  if (g_time_quant)
    g_quant_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - tq0).count();

  const TileFn fn = kind == kQ4_1 ? path.q4_1 : path.q8_0;
  const int rbmax = path.row_block;
  Pool& pl = pool();
  // Units of >= g_unit_bytes of weights (a claim costs an atomic), at most 128 per thread: a thread
  // streams its own contiguous region of units (pool.h), so finer units only even out the finish
  // (the lm_head's 30 MB: units of ~120 KB, so the caller's wait for the last one stays within its spin)
  const int64_t tile_bytes = B * blk;
  const int64_t per = std::max<int64_t>({(g_unit_bytes + tile_bytes - 1) / tile_bytes,
                                         (T + (int64_t)pl.size() * 128 - 1) / ((int64_t)pl.size() * 128),
                                         (T + Pool::kMaxUnits - 1) / Pool::kMaxUnits});
  const int64_t nunits = (T + per - 1) / per;
  auto work = [&](int u) {
    const int64_t t1 = std::min(T, (u + 1) * per);
    for (int64_t t = u * per; t < t1; ++t) {
      const uint8_t* w = wp + t * B * blk;
      const int ncols = (int)std::min<int64_t>(kTile, N - t * kTile);
      for (int64_t r = 0; r < M; r += rbmax)
        fn(w, a, (int)r, (int)std::min<int64_t>(rbmax, M - r), yp + t * kTile, (int)N, ncols);
    }
  };
  pl.run(work, (int)nunits);
}

// Streaming read of n bytes by the pool (256 KB units, 64-byte vector loads, no writes): the read
// bandwidth the GEMM's weight streaming can hope for on this machine. Returns the best of `reps`
// passes in seconds; *sink receives a value that depends on every byte (keeps the loads alive).
inline double read_probe(const uint8_t* p, int64_t n, int reps, int64_t* sink) {
  constexpr int64_t kUnit = 256 << 10;
  const int64_t units = (n + kUnit - 1) / kUnit;
  std::vector<int64_t> part(units, 0);
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool().run(
        [&](int u) {
          const uint8_t* q = p + u * kUnit;
          const int64_t len = std::min(kUnit, n - u * kUnit);
          int64_t i = 0, tot = 0;
#if defined(__AVX512F__)
          __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
          for (; i + 256 <= len; i += 256) {
            a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void*)(q + i)));
            a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void*)(q + i + 64)));
            a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void*)(q + i + 128)));
            a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void*)(q + i + 192)));
          }
          tot = _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
#elif defined(__AVX2__)
          __m256i a0 = _mm256_setzero_si256(), a1 = a0;
          for (; i + 64 <= len; i += 64) {
            a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)(q + i)));
            a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(q + i + 32)));
          }
          a0 = _mm256_xor_si256(a0, a1);
          tot = _mm256_extract_epi64(a0, 0) ^ _mm256_extract_epi64(a0, 1) ^ _mm256_extract_epi64(a0, 2) ^
                _mm256_extract_epi64(a0, 3);
#endif
          for (; i < len; ++i) tot += q[i];
          part[u] = tot;
        },
        (int)units);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int64_t acc = 0;
  for (int64_t v : part) acc += v;
  *sink = acc;
  return best;
}

}  // namespace td

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

enum Kind { kQ4_1 = 0, kQ8_0 = 1, kF32 = 2 };  // kF32: float32 (N, K) weights, fused.h only (f32mm.h)

struct Path {
  const char* name;
  TileFn q4_1;
  TileFn q8_0;
  int row_block;
  TileFn q4_1_pair = nullptr;  // two full Q4_1 tiles (32 columns) at once, up to pair_rows rows a call; same bits
  int pair_rows = 0;
};

inline std::vector<Path> compiled_paths() {
  std::vector<Path> p;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  p.push_back({"avx512vnni", tile_q4_1_vnni, tile_q8_0_vnni, kRowBlockAvx512, tile2_q4_1_vnni, kPairRows});
#endif
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
// Whether mm_act runs full Q4_1 tiles in pairs where the path has a pair kernel (qgemm.set_q4_pair; timing A/Bs)
inline bool g_q4_pair = true;
// Profiling only (FusedDecoder.set_profile): wall time mm_into spends quantizing activations, in ns.
inline bool g_time_quant = false;
inline int64_t g_quant_ns = 0;
inline int g_spin_us = 100;
// then poll with sched_yield this long before sleeping (pool.h; qgemm.set_yield_us, TREEDRAFT_POOL_YIELD_US)
inline int g_yield_us = 2000;
inline std::unique_ptr<Pool> g_pool;

inline Pool& pool() {
  if (g_pool && g_pool->pid() != getpid()) {
    (void)g_pool.release();  // forked child: the parent's threads do not exist here; leak it
  }
  if (!g_pool || g_pool->size() != g_threads) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(g_threads, g_spin_us, g_yield_us);
  }
  return *g_pool;
}

#if defined(__AVX512F__)
// The code of v = x * id: round to nearest even, clamped to [-127, 127]. Clamping first and rounding in the
// conversion equals rounding first (the bounds are integers, rounding is monotonic), and max_ps(NaN, -127)
// = -127 as the scalar path's std::max(-127.f, NaN) gives; an infinite v (id = inf after a denormal d) clamps.
inline __m512i clamp_round(__m512 v, __m512 nlim, __m512 lim) {
  return _mm512_cvt_roundps_epi32(_mm512_min_ps(_mm512_max_ps(v, nlim), lim),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
#endif

// Quantize one row's block of 32 floats. Identical arithmetic on every path (IEEE division,
// multiply, round-to-nearest-even), so a row's codes never depend on the path or the batch.
inline void quantize_block(const float* x, int8_t* q, float* d_out, float* s_out, int32_t* n_out) {
#if defined(__AVX512F__)
  const __m512 a0 = _mm512_loadu_ps(x), a1 = _mm512_loadu_ps(x + 16);
  const float amax =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 vid = _mm512_set1_ps(id), lim = _mm512_set1_ps(127.f);
  const __m512 nlim = _mm512_sub_ps(_mm512_setzero_ps(), lim);
  const __m512i i0 = clamp_round(_mm512_mul_ps(a0, vid), nlim, lim);
  const __m512i i1 = clamp_round(_mm512_mul_ps(a1, vid), nlim, lim);
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
  *n_out = -128 * sum;
}

#if defined(__AVX512F__)
// Transposed reduction of 16 vectors: lane j of the result = op over the 16 lanes of v[j] (op exact
// and commutative: float max, integer add, so the lane order inside the tree is free). Four levels of
// 128-bit-lane / in-lane shuffles, 15 ops each, instead of 16 separate horizontal reductions.
template <class Op>
inline __m512 transpose_reduce16(const __m512* v, Op op) {
  __m512 r[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes: (v2i 0^2, v2i 1^3, v2i+1 0^2, v2i+1 1^3)
    r[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane k: block 4i + k, 4 partials
    t[i] = op(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88), _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // lane k: blocks 8i + k and 8i + 4 + k, 2 partials each
    u[i] = op(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  // element 4k + j: block k + 4j; permute to element n = block n
  const __m512 w = op(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

// 16 consecutive blocks of one row (x: 512 floats): quantize_block's arithmetic for each, with the
// per-block max / sum reductions, the division and the reciprocal done 16 blocks at a time.
// Block j's codes go to q + j * qstride, its d / s / n to d_out / s_out / n_out [j * dstride].
inline void quantize_16blocks(const float* x, int8_t* q, int64_t qstride, float* d_out, float* s_out, int32_t* n_out,
                              int64_t dstride) {
  __m512 v[16];
  for (int j = 0; j < 16; ++j)
    v[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 32 * j)), _mm512_abs_ps(_mm512_loadu_ps(x + 32 * j + 16)));
  const __m512 amax = transpose_reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); });
  const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
  // id = d != 0 ? 1 / d : 0 (unordered compare: a NaN d gives 1 / d as the scalar `!=` does)
  const __m512 id =
      _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1.f), d);
  alignas(64) float ids[16];
  _mm512_store_ps(ids, id);
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_sub_ps(_mm512_setzero_ps(), lim);
  for (int j = 0; j < 16; ++j) {
    const __m512 vid = _mm512_set1_ps(ids[j]);
    const __m512i i0 = clamp_round(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * j), vid), nlim, lim);
    const __m512i i1 = clamp_round(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * j + 16), vid), nlim, lim);
    _mm_storeu_si128((__m128i*)(q + j * qstride), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(q + j * qstride + 16), _mm512_cvtsepi32_epi8(i1));
    v[j] = _mm512_castsi512_ps(_mm512_add_epi32(i0, i1));
  }
  const __m512i sum = _mm512_castps_si512(transpose_reduce16(v, [](__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }));
  alignas(64) float dd[16], ss[16];
  alignas(64) int32_t nn[16];
  _mm512_store_ps(dd, d);
  _mm512_store_ps(ss, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));  // d * (float)sum, |sum| <= 4064: exact
  _mm512_store_si512((void*)nn, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
  for (int j = 0; j < 16; ++j) {
    d_out[j * dstride] = dd[j];
    s_out[j * dstride] = ss[j];
    n_out[j * dstride] = nn[j];
  }
}
#endif

// Quantized activations in the kernels' block-major (B, M, 32) layout, owned by the caller.
struct ActBuf {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> n;
  int64_t M = 0, K = 0;

  // Sizes the buffers for M rows of length K (a multiple of 32); call before quantize_row.
  void prepare(int64_t rows, int64_t len) {
    M = rows;
    K = len;
    q.resize(rows * len);
    d.resize(rows * (len / kQK));
    s.resize(rows * (len / kQK));
    n.resize(rows * (len / kQK));
  }

  Act view() const {
    Act a;
    a.M = (int)M;
    a.K = (int)K;
    a.B = (int)(K / kQK);
    a.q = q.data();
    a.d = d.data();
    a.s = s.data();
    a.n = n.data();
    return a;
  }

  // Quantize row m (x: K floats) into its slots. Thread-safe for distinct m once prepared.
  void quantize_row(const float* x, int64_t m) {
    const int64_t B = K / kQK;
    int64_t b = 0;
#if defined(__AVX512F__)
    for (; b + 16 <= B; b += 16)
      quantize_16blocks(x + b * kQK, q.data() + (b * M + m) * kQK, M * kQK, d.data() + b * M + m, s.data() + b * M + m,
                        n.data() + b * M + m, M);
#endif
    for (; b < B; ++b)
      quantize_block(x + b * kQK, q.data() + (b * M + m) * kQK, d.data() + b * M + m, s.data() + b * M + m,
                     n.data() + b * M + m);
  }
};

// Row passes (activation quantization, fused.h's per-row work) of at least this many 32-blocks in all go
// over the pool; smaller ones stay on the caller (a row's bits never depend on the thread that computes
// it). Set by qgemm.set_row_pass_blocks. Default: every pass on the caller. Measured on the 2-core Xeon at
// load average ~7 (three jobs), the pool setting 64 made 4-16-row forwards 6-11% slower, wall and caller CPU
// time alike (benchmarks/row_pass_ab.py; the worker, sharing its core, finishes its rows late and the
// caller waits). On a quiet 2-core Zen 5 EPYC (session 9, same script) it measured 0.96-1.02x at 1-16 rows.
constexpr int64_t kRowPassCaller = int64_t(1) << 40;
inline int64_t g_par_blocks = kRowPassCaller;

// Whether M rows of len floats each go over the pool (mm_core's quantize_rows, fused.h's rows()).
inline bool rows_on_pool(int64_t M, int64_t len) {
  return M >= 2 && M * (len / kQK) >= g_par_blocks && pool().size() > 1;
}

// Quantize x (M, K) row-major into buf (prepared here); rows spread over the pool when worth it.
inline void quantize_rows(const float* x, int64_t M, int64_t K, ActBuf& buf) {
  buf.prepare(M, K);
  if (rows_on_pool(M, K))
    pool().run([&](int m) { buf.quantize_row(x + (int64_t)m * K, m); }, (int)M);
  else
    for (int64_t m = 0; m < M; ++m) buf.quantize_row(x + m * K, m);
}

// Validate the call; returns the tile function of the requested path.
inline const Path& pick_path(const std::string& name) {
  static const std::vector<Path> paths = compiled_paths();
  if (name.empty()) return paths.front();
  for (const auto& p : paths)
    if (name == p.name) return p;
  TORCH_CHECK(false, "treedraft qgemm: unknown or uncompiled path '", name, "'");
}


// y (M, N) row-major = a @ W^T for activations already quantized (a.M rows of a.K) and a packed
// weight wp of `kind`; no checks (the callers validate shapes).
inline void mm_act(const Act& a, const uint8_t* wp, int64_t N, int kind, const Path& path, float* yp) {
  const int64_t M = a.M, B = a.B;
  if (M == 0 || N == 0) return;
  const int64_t T = (N + kTile - 1) / kTile;
  const int64_t blk = kind == kQ4_1 ? kQ41Bytes : kQ80Bytes;
  const TileFn fn = kind == kQ4_1 ? path.q4_1 : path.q8_0;
  // Q4_1 where the path has a 32-column kernel: full tiles go in pairs (a unit holds an even number of tiles)
  const TileFn pair = kind == kQ4_1 && g_q4_pair ? path.q4_1_pair : nullptr;
  // row chunks of at most path.row_block (pair_rows for pairs), evened out (20 rows: 10 + 10, not 16 + 4; a
  // row's bits do not depend on its chunk)
  auto chunk_rows = [M](int64_t most) { const int64_t n = (M + most - 1) / most; return (M + n - 1) / n; };
  const int64_t rb = chunk_rows(path.row_block), prb = pair ? chunk_rows(path.pair_rows) : M;
  Pool& pl = pool();
  // Units of >= g_unit_bytes of weights (a claim costs an atomic), at most 128 per thread: a thread
  // streams its own contiguous region of units (pool.h), so finer units only even out the finish
  // (the lm_head's 30 MB: units of ~120 KB, so the caller's wait for the last one stays within its spin)
  const int64_t tile_bytes = B * blk;
  const int64_t per1 = std::max<int64_t>({(g_unit_bytes + tile_bytes - 1) / tile_bytes,
                                         (T + (int64_t)pl.size() * 128 - 1) / ((int64_t)pl.size() * 128),
                                         (T + Pool::kMaxUnits - 1) / Pool::kMaxUnits});
  // pairs: an even number of tiles per unit, rounded down (up would leave fewer units to share: 36 tiles in 3s are
  // 12 units, 6 per thread; in 4s 9, 5 and 4) unless that makes more units than the pool takes
  const int64_t per_even = std::max<int64_t>(2, per1 / 2 * 2);
  const int64_t per = !pair ? per1 : (T + per_even - 1) / per_even <= Pool::kMaxUnits ? per_even : per_even + 2;
  const int64_t nunits = (T + per - 1) / per;
  auto work = [&](int u) {
    const int64_t t1 = std::min(T, (u + 1) * per);
    for (int64_t t = u * per; t < t1; ++t) {
      const uint8_t* w = wp + t * B * blk;
      if (pair && t + 1 < t1 && (t + 2) * kTile <= N) {
        for (int64_t r = 0; r < M; r += prb)
          pair(w, a, (int)r, (int)std::min<int64_t>(prb, M - r), yp + t * kTile, (int)N, 2 * kTile);
        ++t;
        continue;
      }
      const int ncols = (int)std::min<int64_t>(kTile, N - t * kTile);
      for (int64_t r = 0; r < M; r += rb)
        fn(w, a, (int)r, (int)std::min<int64_t>(rb, M - r), yp + t * kTile, (int)N, ncols);
    }
  };
  pl.run(work, (int)nunits);
}

// y (M, N) row-major = x (M, K) row-major @ W^T for a packed weight wp of `kind`; no checks (the
// callers validate shapes). Shared by the Python-facing mm and the fused decoder (fused.h).
inline void mm_into(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, int kind,
                    const Path& path, float* yp) {
  if (M == 0 || N == 0) return;
  thread_local ActBuf buf;
  const auto tq0 = g_time_quant ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point();
  quantize_rows(xp, M, K, buf);  // block-major (B, M, 32) codes: a kernel finds a block's rows at constant offsets
  if (g_time_quant)
    g_quant_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - tq0).count();
  mm_act(buf.view(), wp, N, kind, path, yp);
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

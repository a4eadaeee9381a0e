// Row-invariant float32 GEMM for the fp32 weights path: y (M, N) = x (M, K) @ w (N, K)^T.
//
// Every output is attn.h's dot(x[m], w[n]) whatever M, the register tile or the thread that computes it:
// 16 lane accumulators, lane l = fma(x[16i + l], w[16i + l], lane l) over i ascending, the K % 16 tail
// elements into lanes 0.. with fma, then the lanes added as the tree (l += l+8, l += l+4, l += l+2, l += l+1).
// So a tree row equals the 1-token row bit for bit (BLAS GEMMs change their blocking with M: MKL's rows
// differed by up to 8e-5 between a 1-row and a 16-row call here, which can flip a greedy near-tie), and the
// AVX-512 / AVX2 / scalar paths give the same bits. Weights stream once per call for all rows: register tiles of
// 3-6 rows x 4 outputs (AVX-512; 1-2 rows x 8 outputs), of 3 x 2 / 2 x 3 / 1 x 6 (AVX2), output blocks of kUnitN
// spread over the pool, each block's row groups one after another.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "attn.h"  // dot<>, tree8, reduce16 (the lane tree)
#include "pool.h"

namespace td {
namespace f32mm {

constexpr int kUnitN = 32;  // outputs per pool work unit (576 outputs: 18 units, even on 2 threads)

// The reference arithmetic (any K): attn::dot<kScalar>.
inline float dot_ref(const float* x, const float* w, int K) { return attn::dot<attn::kScalar>(x, w, K); }

#if defined(__AVX512F__)
// Rows x[0..MR) against outputs w[0..NB) (row n at w + n * K), K % 16 == 0; y[m * ldy + n].
template <int MR, int NB>
inline void tile_avx512(const float* const* x, const float* w, int64_t K, float* y, int64_t ldy) {
  static_assert(MR * NB <= 24, "at most 24 accumulators");
  constexpr int kAcc = MR * NB <= 16 ? 16 : 32;  // reduce16 takes them 16 at a time (zeros past MR * NB)
  __m512 a[kAcc];
  for (int t = 0; t < kAcc; ++t) a[t] = _mm512_setzero_ps();
  const int64_t nv = K / 16;
  for (int64_t i = 0; i < nv; ++i) {
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm512_loadu_ps(w + n * K + 16 * i);
    // the tile after next's NB rows are the NB * K floats from 2 * NB * K on: fetch them in address order, NB
    // cache lines per step, into L2 (T1), so they arrive while this tile and the next compute (a row is only K / 16
    // steps long). Into L1 (T0) and one tile ahead, as before, an 8 / 16-row fp32 forward's linears took 26 / 40 ms
    // against 18 / 31 (Zen 4, 2 threads, weights streamed from memory; 1 row the same within noise): L1 prefetches
    // hold its few miss buffers, and the loads wait on them
    for (int n = 0; n < NB; ++n) _mm_prefetch((const char*)(w + 2 * NB * K + (i * NB + n) * 16), _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + 16 * i);
      for (int n = 0; n < NB; ++n) a[m * NB + n] = _mm512_fmadd_ps(xv, wv[n], a[m * NB + n]);
    }
  }
  alignas(64) float out[kAcc];
  for (int t = 0; t < kAcc; t += 16)
    _mm512_store_ps(out + t, attn::reduce16(a + t));  // lane t = accumulator t through dot's lane tree
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n] = out[m * NB + n];
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// AVX2: lanes 0..7 and 8..15 of each output in two accumulators, reduced by tree8 (dot<kAvx2>'s bits).
template <int MR, int NB>
inline void tile_avx2(const float* const* x, const float* w, int64_t K, float* y, int64_t ldy) {
  static_assert(MR * NB <= 6, "at most 12 accumulators");
  __m256 lo[MR * NB], hi[MR * NB];
  for (int t = 0; t < MR * NB; ++t) lo[t] = hi[t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    // the tile after next's rows into L2, as the AVX-512 tile does (8 rows: 31-34 -> 25-28 ms for the model's
    // linears, the AVX2 build on the Zen 4; none before)
    for (int n = 0; n < NB; ++n) _mm_prefetch((const char*)(w + 2 * NB * K + k * NB + 16 * n), _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      const __m256 x0 = _mm256_loadu_ps(x[m] + k), x1 = _mm256_loadu_ps(x[m] + k + 8);
      for (int n = 0; n < NB; ++n) {
        lo[m * NB + n] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w + n * K + k), lo[m * NB + n]);
        hi[m * NB + n] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w + n * K + k + 8), hi[m * NB + n]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n] = attn::tree8(lo[m * NB + n], hi[m * NB + n]);
}
#endif

#if defined(__AVX512F__)
// Outputs [n0, n1) of MR rows: NB-wide tiles, then 1-wide ones for the remainder (same per-output arithmetic).
template <int MR, int NB>
inline void rows_avx512(const float* const* xr, const float* w, int64_t K, float* yr, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile_avx512<MR, NB>(xr, w + n * K, K, yr + n, N);
  for (; n < n1; ++n) tile_avx512<MR, 1>(xr, w + n * K, K, yr + n, N);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
template <int MR, int NB>
inline void rows_avx2(const float* const* xr, const float* w, int64_t K, float* yr, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) tile_avx2<MR, NB>(xr, w + n * K, K, yr + n, N);
  for (; n < n1; ++n) tile_avx2<MR, 1>(xr, w + n * K, K, yr + n, N);
}
#endif

// Outputs [n0, n1) of every row; y row-major (M, N).
inline void block(const float* x, int64_t M, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y,
                  int isa) {
  int64_t m = 0;
#if defined(__AVX512F__)
  if (isa >= attn::kAvx512 && K % 16 == 0) {
    while (m < M) {
      const float* xr[6];
      // groups of 6 rows, then the rest as one group: every group reads the block's weights again (from L2 after
      // the first), so 5 rows as 4 + 1 or 9 as 6 + 2 + 1 cost a group more than 5 / 6 + 3 (the model's linears,
      // Zen 4, 2 threads, benchmarks/f32mm_rows.cpp: 3 and 5 rows 9-24 % faster, 9 / 11 / 15 / 17 rows 4-7 %; even
      // counts unchanged)
      const int64_t mr = std::min<int64_t>(6, M - m);
      for (int r = 0; r < mr; ++r) xr[r] = x + (m + r) * K;
      float* yr = y + m * N;
      if (mr == 6) rows_avx512<6, 4>(xr, w, K, yr, N, n0, n1);
      else if (mr == 5) rows_avx512<5, 4>(xr, w, K, yr, N, n0, n1);
      else if (mr == 4) rows_avx512<4, 4>(xr, w, K, yr, N, n0, n1);
      else if (mr == 3) rows_avx512<3, 4>(xr, w, K, yr, N, n0, n1);
      else if (mr == 2) rows_avx512<2, 8>(xr, w, K, yr, N, n0, n1);
      else rows_avx512<1, 8>(xr, w, K, yr, N, n0, n1);
      m += mr;
    }
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= attn::kAvx2 && K % 16 == 0) {
    while (m < M) {
      // groups of 3 rows, then the rest: the first group streams the weights from memory and its FMAs hide under
      // that, so it should be the biggest; the others re-read them from L2 at ~the same cost per row. The AVX2 build
      // on the Zen 4, the model's linears against the pairs of before: 15-24 % faster at 3-16 rows, 1-2 rows the same
      // (a rest of 4 as 2 + 2 instead of 3 + 1 was 11-18 % slower at 4 / 7 / 10 / 13 / 16 rows)
      const float* xr[3];
      const int64_t mr = std::min<int64_t>(3, M - m);
      for (int r = 0; r < mr; ++r) xr[r] = x + (m + r) * K;
      float* yr = y + m * N;
      if (mr == 3) rows_avx2<3, 2>(xr, w, K, yr, N, n0, n1);
      else if (mr == 2) rows_avx2<2, 3>(xr, w, K, yr, N, n0, n1);
      else rows_avx2<1, 6>(xr, w, K, yr, N, n0, n1);
      m += mr;
    }
    return;
  }
#endif
  for (; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] = dot_ref(x + m * K, w + n * K, (int)K);
}

// y (M, N) = x (M, K) @ w (N, K)^T over the pool, output blocks of kUnitN.
inline void mm(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int isa, Pool& pool) {
  const int units = (int)((N + kUnitN - 1) / kUnitN);
  pool.run([&](int u) { block(x, M, K, w, N, (int64_t)u * kUnitN, std::min<int64_t>(N, (int64_t)(u + 1) * kUnitN), y, isa); },
           units);
}

}  // namespace f32mm
}  // namespace td

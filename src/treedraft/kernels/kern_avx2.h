// AVX2 kernels (e.g. AMD Zen 2/3): the same packed layout, processed as two halves of 8 columns
// (bytes 0..31 / 32..63 of each 64-byte group), 4 activation rows per pass (16 ymm registers).
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "common.h"

namespace td {

inline void store8(float* dst, __m256 v, int ncols) {
  if (ncols >= 8) {
    _mm256_storeu_ps(dst, v);
  } else if (ncols > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    for (int c = 0; c < ncols; ++c) dst[c] = tmp[c];
  }
}

// Without AVX-512 the compiler has 16 ymm registers: with the k-group loop unrolled it computed all 32 products
// of a block first and spilled them (48 ymm stack moves in the RB = 4 tile; the Q8_0 tile below: 68). The loop
// kept rolled, each group's products go straight into the rows' int16 sums (exact integer adds, so the order is
// free and the bits stay the other paths'): ~1.25x fewer cycles per (row, block) at 4+ rows built for Zen 3
// (-march=znver3), cache-resident, one thread (benchmarks/results/session18.md); 1-2 rows keep the unrolled loop.
template <int RB>
void tile_q4_1_avx2_rb(const uint8_t* w0, const Act& a, int r0, float* out, int ldo, int ncols) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int pf = g_prefetch_ahead;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    const int8_t* xb = a.q + (int64_t)r0 * kQK;  // block b's rows: xb + r * 32, one block (M rows) apart
    const float* db = a.d + r0;
    const float* sb = a.s + r0;
    for (int b = 0; b < a.B; ++b, w += kQ41Bytes, xb += (int64_t)a.M * kQK, db += a.M, sb += a.M) {
      // as the AVX-512 tiles, for 3+ rows (1-2 rows: 0.92-0.95x, the hardware prefetcher keeps up with their stream);
      // later halves and row chunks re-read what this brings in
      if (RB >= 3 && h == 0 && r0 == 0 && pf > 0) {
        _Pragma("GCC unroll 5")
        for (int l = 0; l < kQ41Bytes; l += 64) _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
      }
      __m256i s16[RB];
      _Pragma("GCC unroll 8")
      for (int r = 0; r < RB; ++r) s16[r] = _mm256_setzero_si256();
      // k group i (k = 4i.. and 16 + 4i..) of this half's 8 columns, for the RB rows
      auto group = [&](int i) __attribute__((always_inline)) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * i + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RB; ++r) {
          const int8_t* xr = xb + r * kQK + 4 * i;
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(load_i32(xr))));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load_i32(xr + 16))));
        }
      };
      if constexpr (RB <= 2) {  // few rows: no spills unrolled, and the 1-row (memory-bound) step keeps its loads early
        group(0), group(1), group(2), group(3);
      } else {
        _Pragma("GCC unroll 1")
        for (int i = 0; i < 4; ++i) group(i);
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 256 + 16 * h)));
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 288 + 16 * h)));
      _Pragma("GCC unroll 8")
      for (int r = 0; r < RB; ++r) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], _mm256_set1_epi16(1)));
        acc[r] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(db[r])), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sb[r]), acc[r]);
      }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; ++r)
      store8(out + (int64_t)(r0 + r) * ldo + 8 * h, acc[r], ncols - 8 * h);
  }
}

// Q8_0: llama.cpp's vpsignb trick: vpmaddubsw(|w|, sign(x, w)) = w x per byte pair exactly (pairs
// <= 2 * 128 * 127 < 32767), widened at once by vpmaddwd with ones (two pairs could exceed int16).
template <int RB>
void tile_q8_0_avx2_rb(const uint8_t* w0, const Act& a, int r0, float* out, int ldo, int ncols) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int pf = g_prefetch_ahead;
  const int8_t* x0 = a.q + (int64_t)r0 * kQK;
  const float* d0 = a.d + r0;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[RB];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* w = w0;
    for (int b = 0; b < a.B; ++b, w += kQ80Bytes) {
      if (RB >= 3 && h == 0 && r0 == 0 && pf > 0) {
        _Pragma("GCC unroll 9")
        for (int l = 0; l < kQ80Bytes; l += 64) _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
      }
      __m256i s32[RB];
      _Pragma("GCC unroll 8")
      for (int r = 0; r < RB; ++r) s32[r] = _mm256_setzero_si256();
      const int8_t* xb = x0 + (int64_t)b * a.M * kQK;  // block b's rows: xb + r * 32
      auto group = [&](int i) __attribute__((always_inline)) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + 64 * i + 32 * h));
        const __m256i av = _mm256_abs_epi8(v);  // |-128| = 0x80 = 128 as the unsigned operand
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RB; ++r) {
          const __m256i xv = _mm256_set1_epi32(load_i32(xb + r * kQK + 4 * i));
          const __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v));
          s32[r] = _mm256_add_epi32(s32[r], _mm256_madd_epi16(p, ones));
        }
      };
      // as in the Q4_1 tile: unrolled only where it does not spill (fully unrolled at RB = 4: 68 ymm stack moves;
      // by 2: 1.0-1.15x at 4+ rows)
      if constexpr (RB <= 2) {
        _Pragma("GCC unroll 8")
        for (int i = 0; i < 8; ++i) group(i);
      } else {
        _Pragma("GCC unroll 2")
        for (int i = 0; i < 8; ++i) group(i);
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w + 512 + 16 * h)));
      _Pragma("GCC unroll 8")
      for (int r = 0; r < RB; ++r) {
        const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(d0[(int64_t)b * a.M + r]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32[r]), sc, acc[r]);
      }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; ++r)
      store8(out + (int64_t)(r0 + r) * ldo + 8 * h, acc[r], ncols - 8 * h);
  }
}

constexpr int kRowBlockAvx2 = 4;

inline void tile_q4_1_avx2(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                           int ncols) {
  switch (rb) {
    case 1: tile_q4_1_avx2_rb<1>(w, a, r0, out, ldo, ncols); break;
    case 2: tile_q4_1_avx2_rb<2>(w, a, r0, out, ldo, ncols); break;
    case 3: tile_q4_1_avx2_rb<3>(w, a, r0, out, ldo, ncols); break;
    default: tile_q4_1_avx2_rb<4>(w, a, r0, out, ldo, ncols); break;
  }
}

inline void tile_q8_0_avx2(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                           int ncols) {
  switch (rb) {
    case 1: tile_q8_0_avx2_rb<1>(w, a, r0, out, ldo, ncols); break;
    case 2: tile_q8_0_avx2_rb<2>(w, a, r0, out, ldo, ncols); break;
    case 3: tile_q8_0_avx2_rb<3>(w, a, r0, out, ldo, ncols); break;
    default: tile_q8_0_avx2_rb<4>(w, a, r0, out, ldo, ncols); break;
  }
}

}  // namespace td
#endif

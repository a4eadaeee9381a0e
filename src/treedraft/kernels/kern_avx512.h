// AVX-512BW kernels: one zmm holds 16 output columns; a weight tile is unpacked once per block
// and applied to RB activation rows held in registers (integer dot products as llama.cpp's
// ggml_vec_dot_q4_1_q8_1: vpmaddubsw unsigned nibbles x signed int8, vpmaddwd with ones; or vpdpbusd
// where AVX512_VNNI is compiled in: the "avx512vnni" path, same bits).
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "common.h"

namespace td {

inline void store16(float* dst, __m512 v, int ncols) {
  if (ncols >= kTile)
    _mm512_storeu_ps(dst, v);
  else
    _mm512_mask_storeu_ps(dst, (__mmask16)((1u << ncols) - 1), v);
}

// Integer dot products per (row, block), in int32 lanes, one per output column: w holds the block's 16
// columns as 8 vectors of 4-byte k groups (unsigned), xr the row's 32 int8 codes. Both variants sum the
// same exact integers, so every output bit is the same whichever runs.
//
// Q4_1 without VNNI (as llama.cpp's ggml_vec_dot_q4_1_q8_1): 8 vpmaddubsw (unsigned nibbles x signed int8)
// summed in int16 (|sum| <= 8 * 2 * 15 * 127 = 30480, no saturation since activations are clamped to
// [-127, 127]), widened once by vpmaddwd with ones.
// With AVX512_VNNI (Ice Lake and later Xeons, AMD Zen 4/5): vpdpbusd multiplies unsigned by signed bytes,
// sums each group of 4 products and adds to int32 lanes in one instruction: 8 vpdpbusd in two chains +
// vpaddd against 8 vpmaddubsw + 7 vpaddw + vpmaddwd.
#if defined(__AVX512VNNI__)
// init + sum over the block of w (8 vectors of unsigned bytes, k groups as above) times the row's codes xr (signed,
// broadcast 4 at a time): 8 vpdpbusd in two chains. Shared by Q4_1 (nibbles, init 0) and Q8_0 (dot_q8_biased).
__attribute__((always_inline)) inline __m512i dot_vnni(const __m512i* w, const int8_t* xr, __m512i init) {
  __m512i s0 = init, s1 = _mm512_setzero_si512();
  _Pragma("GCC unroll 8")
  for (int i = 0; i < 8; i += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[i], _mm512_set1_epi32(load_i32(xr + 4 * i)));
    s1 = _mm512_dpbusd_epi32(s1, w[i + 1], _mm512_set1_epi32(load_i32(xr + 4 * i + 4)));
  }
  return _mm512_add_epi32(s0, s1);
}
#endif

template <bool VNNI>
__attribute__((always_inline)) inline __m512i dot_q4(const __m512i* wv, const int8_t* xr) {
#if defined(__AVX512VNNI__)
  if constexpr (VNNI) return dot_vnni(wv, xr, _mm512_setzero_si512());
#endif
  __m512i xv[8];  // the row's 4-byte groups broadcast (k = 4i.. and 16+4i..)
  _Pragma("GCC unroll 8")
  for (int i = 0; i < 8; ++i) xv[i] = _mm512_set1_epi32(load_i32(xr + 4 * i));
  __m512i s16 = _mm512_maddubs_epi16(wv[0], xv[0]);
  _Pragma("GCC unroll 7")
  for (int i = 1; i < 8; ++i) s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(wv[i], xv[i]));
  return _mm512_madd_epi16(s16, _mm512_set1_epi16(1));
}

// Q8_0 without VNNI (llama.cpp's signed-by-signed trick: the byte multiplies take one unsigned operand): per 4-k group
// |w| as the unsigned operand and x with w's sign applied (a masked byte subtract from zero; AVX-512BW has no vpsignb),
// so |w| * sign(w) x = w x exactly. |w| <= 128, |x| <= 127: a pair sums to <= 2 * 128 * 127 = 32512 < 32767, but two
// pairs can exceed int16, so every vpmaddubsw is widened at once by vpmaddwd with ones. Per (row, block): 8 x
// (vpbroadcastd load, masked vpsubb, vpmaddubsw, vpmaddwd, vpaddd). (VNNI builds: dot_q8_biased.)
__attribute__((always_inline)) inline __m512i dot_q8(const __m512i* wa, const __mmask64* neg, const int8_t* xr) {
  const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
  __m512i s0 = zero, s1 = zero;
  _Pragma("GCC unroll 8")
  for (int i = 0; i < 8; i += 2) {
    const __m512i x0 = _mm512_set1_epi32(load_i32(xr + 4 * i));
    const __m512i x1 = _mm512_set1_epi32(load_i32(xr + 4 * i + 4));
    const __m512i y0 = _mm512_mask_sub_epi8(x0, neg[i], zero, x0);
    const __m512i y1 = _mm512_mask_sub_epi8(x1, neg[i + 1], zero, x1);
    s0 = _mm512_add_epi32(s0, _mm512_madd_epi16(_mm512_maddubs_epi16(wa[i], y0), ones));
    s1 = _mm512_add_epi32(s1, _mm512_madd_epi16(_mm512_maddubs_epi16(wa[i + 1], y1), ones));
  }
  return _mm512_add_epi32(s0, s1);  // exact integer sum
}

// Q4_1 tile: per block the 12 ops unpacking it are shared by the RB rows; per (row, block) the dot above,
// then vcvtdq2ps + vmulps + 2 vfmadd. The row loop is unrolled so accumulators, broadcasts and weights stay
// in registers (26 zmm at RB = 8). RB goes up to 16: a 16-row step unpacks each block once instead of
// twice, and its accumulators still fit in the 32 zmm (a cache-resident 16-row tile costs ~7% fewer cycles
// than two 8-row passes, benchmarks/tile_cycles.cpp).
template <int RB, bool VNNI>
void tile_q4_1_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int pf = g_prefetch_ahead;
  __m512 acc[RB];
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < a.B; ++b, w += kQ41Bytes) {
    if (r0 == 0 && pf > 0) {  // later row chunks of this tile re-read blocks the first one brought in
      _Pragma("GCC unroll 5")
      for (int l = 0; l < kQ41Bytes; l += 64)
        _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
    }
    // the block's 16 x 32 weights, unpacked once: wv[i] holds k = 4i..4i+3 (i < 4) and
    // 16+4(i-4).. (i >= 4) of all 16 columns; they stay in registers for all RB rows
    __m512i wv[8];
    _Pragma("GCC unroll 4")
    for (int i = 0; i < 4; ++i) {
      const __m512i v = _mm512_loadu_si512((const void*)(w + 64 * i));
      wv[i] = _mm512_and_si512(v, low4);
      wv[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 256)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 288)));
    const int8_t* xb = a.q + ((int64_t)b * a.M + r0) * kQK;  // row r at xb + 32 r
    const float* db = a.d + (int64_t)b * a.M + r0;
    const float* sb = a.s + (int64_t)b * a.M + r0;
    _Pragma("GCC unroll 16")
    for (int r = 0; r < RB; ++r) {
      const __m512 f = _mm512_cvtepi32_ps(dot_q4<VNNI>(wv, xb + r * kQK));
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(db[r])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sb[r]), acc[r]);
    }
  }
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; ++r) store16(out + (int64_t)(r0 + r) * ldo, acc[r], ncols);
}

// Q8_0 with AVX512_VNNI: w + 128 (w XOR 0x80) as vpdpbusd's unsigned operand, once per block for all RB rows, and the
// row's int8 codes as the signed one, broadcast straight from memory: sum (w + 128) x = sum w x + 128 sum x, so the
// exact sum starts from the activation block's -128 sum(q) (Act::n, from the quantization pass) and takes 8 vpdpbusd a
// row, where the VNNI path before session 41 ran 8 x (broadcast, masked vpsubb, vpdpbusd) on |w| and sign-applied codes
// (1.30-1.39x at 1-32 rows on a Sapphire-Rapids-class Xeon). |sum (w + 128) x| <= 32 * 255 * 127: no overflow.
__attribute__((always_inline)) inline __m512i dot_q8_biased(const __m512i* wb, const int8_t* xr, int32_t n) {
#if defined(__AVX512VNNI__)
  return dot_vnni(wb, xr, _mm512_set1_epi32(n));
#else
  (void)wb, (void)xr, (void)n;
  return _mm512_setzero_si512();
#endif
}

// Q8_0 tile: per block |w| and the sign masks (or, with VNNI, w + 128) are computed once for RB rows.
template <int RB, bool VNNI>
void tile_q8_0_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  const int pf = g_prefetch_ahead;
  __m512 acc[RB];
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int b = 0; b < a.B; ++b, w += kQ80Bytes) {
    if (r0 == 0 && pf > 0) {
      _Pragma("GCC unroll 9")
      for (int l = 0; l < kQ80Bytes; l += 64)
        _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
    }
    __m512i wa[8];  // |w| of k = 4i..4i+3, all 16 columns (as unsigned bytes: |-128| = 128); VNNI: w + 128
    __mmask64 neg[8];  // w < 0 (without VNNI)
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; ++i) {
      const __m512i v = _mm512_loadu_si512((const void*)(w + 64 * i));
      if constexpr (VNNI) {
        wa[i] = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
      } else {
        wa[i] = _mm512_abs_epi8(v);
        neg[i] = _mm512_movepi8_mask(v);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 512)));
    const int8_t* xb = a.q + ((int64_t)b * a.M + r0) * kQK;  // row r at xb + 32 r
    const float* db = a.d + (int64_t)b * a.M + r0;
    const int32_t* nb = a.n + (int64_t)b * a.M + r0;
    _Pragma("GCC unroll 16")
    for (int r = 0; r < RB; ++r) {
      __m512i isum;
      if constexpr (VNNI)
        isum = dot_q8_biased(wa, xb + r * kQK, nb[r]);
      else
        isum = dot_q8(wa, neg, xb + r * kQK);
      const __m512 f = _mm512_cvtepi32_ps(isum);
      acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(db[r])), acc[r]);
    }
  }
  _Pragma("GCC unroll 16")
  for (int r = 0; r < RB; ++r) store16(out + (int64_t)(r0 + r) * ldo, acc[r], ncols);
}

#if defined(__AVX512VNNI__)
// Q4_1, 32 columns (two consecutive 16-column tiles: w and w + a.B * kQ41Bytes) x RB <= kPairRows rows, VNNI. Each
// activation broadcast feeds both tiles' vpdpbusd (the single tile spends one broadcast per vpdpbusd, and a zmm
// load, broadcasts included, issued at ~1.1 a cycle on an Ice Lake Xeon against ~1.6 vpdpbusd). A block's k groups
// go in two halves (low nibbles, then high) so that 8 weight registers and 2 RB int32 sums fit, with the 2 RB float
// accumulators in registers up to 6 rows and in L1 from 7. Per (row, tile, block) the same integer sum and then
// exactly tile_q4_1_rb's float operations in the same order, so the bits equal the 16-column tile's.
// Cache-resident, one thread (benchmarks/tile_pair.cpp): 1.17-1.45x per row-block at 1-16 rows on that Xeon.
constexpr int kPairRows = 8;

template <int RB>
void tile2_q4_1_vnni_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int pf = g_prefetch_ahead;
  const uint8_t* w1 = w + (int64_t)a.B * kQ41Bytes;
  constexpr bool kInL1 = RB > 6;  // float accumulators in L1 (loaded and stored once per block)
  __m512 acc[kInL1 ? 1 : RB][2];
  alignas(64) float accl[kInL1 ? RB : 1][2][kTile];
  _Pragma("GCC unroll 8")
  for (int r = 0; r < RB; ++r) {
    if constexpr (kInL1) {
      _mm512_store_ps(accl[r][0], _mm512_setzero_ps());
      _mm512_store_ps(accl[r][1], _mm512_setzero_ps());
    } else {
      acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
  }
  for (int b = 0; b < a.B; ++b, w += kQ41Bytes, w1 += kQ41Bytes) {
    if (r0 == 0 && pf > 0) {
      _Pragma("GCC unroll 5")
      for (int l = 0; l < kQ41Bytes; l += 64) {
        _mm_prefetch((const char*)(w + pf + l), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + pf + l), _MM_HINT_T0);
      }
    }
    const int8_t* xb = a.q + ((int64_t)b * a.M + r0) * kQK;  // row r at xb + 32 r
    __m512i s[RB][2];
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; ++h) {  // k = 4i.. (h = 0: low nibbles) and 16 + 4i.. (h = 1: high nibbles)
      __m512i wv[2][4];
      _Pragma("GCC unroll 4")
      for (int i = 0; i < 4; ++i) {
        const __m512i v0 = _mm512_loadu_si512((const void*)(w + 64 * i));
        const __m512i v1 = _mm512_loadu_si512((const void*)(w1 + 64 * i));
        wv[0][i] = _mm512_and_si512(h == 0 ? v0 : _mm512_srli_epi16(v0, 4), low4);
        wv[1][i] = _mm512_and_si512(h == 0 ? v1 : _mm512_srli_epi16(v1, 4), low4);
      }
      _Pragma("GCC unroll 8")
      for (int r = 0; r < RB; ++r) {
        if (h == 0) s[r][0] = s[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4")
        for (int i = 0; i < 4; ++i) {
          const __m512i x = _mm512_set1_epi32(load_i32(xb + r * kQK + 16 * h + 4 * i));
          s[r][0] = _mm512_dpbusd_epi32(s[r][0], wv[0][i], x);
          s[r][1] = _mm512_dpbusd_epi32(s[r][1], wv[1][i], x);
        }
      }
    }
    const __m512 dw0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 256)));
    const __m512 mw0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w + 288)));
    const __m512 dw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w1 + 256)));
    const __m512 mw1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w1 + 288)));
    const float* db = a.d + (int64_t)b * a.M + r0;
    const float* sb = a.s + (int64_t)b * a.M + r0;
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RB; ++r) {
      const __m512 vd = _mm512_set1_ps(db[r]), vs = _mm512_set1_ps(sb[r]);
      __m512 a0, a1;
      if constexpr (kInL1) {
        a0 = _mm512_load_ps(accl[r][0]), a1 = _mm512_load_ps(accl[r][1]);
      } else {
        a0 = acc[r][0], a1 = acc[r][1];
      }
      a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(dw0, vd), a0);
      a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(dw1, vd), a1);
      a0 = _mm512_fmadd_ps(mw0, vs, a0);
      a1 = _mm512_fmadd_ps(mw1, vs, a1);
      if constexpr (kInL1) {
        _mm512_store_ps(accl[r][0], a0), _mm512_store_ps(accl[r][1], a1);
      } else {
        acc[r][0] = a0, acc[r][1] = a1;
      }
    }
  }
  _Pragma("GCC unroll 8")
  for (int r = 0; r < RB; ++r) {
    if constexpr (kInL1) {
      _mm512_storeu_ps(out + (int64_t)(r0 + r) * ldo, _mm512_load_ps(accl[r][0]));
      _mm512_storeu_ps(out + (int64_t)(r0 + r) * ldo + kTile, _mm512_load_ps(accl[r][1]));
    } else {
      _mm512_storeu_ps(out + (int64_t)(r0 + r) * ldo, acc[r][0]);
      _mm512_storeu_ps(out + (int64_t)(r0 + r) * ldo + kTile, acc[r][1]);
    }
  }
}

// Two full tiles (32 columns); ncols is unused (the driver pairs full tiles only).
inline void tile2_q4_1_vnni(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo, int) {
  switch (rb) {
    case 1: tile2_q4_1_vnni_rb<1>(w, a, r0, out, ldo); break;
    case 2: tile2_q4_1_vnni_rb<2>(w, a, r0, out, ldo); break;
    case 3: tile2_q4_1_vnni_rb<3>(w, a, r0, out, ldo); break;
    case 4: tile2_q4_1_vnni_rb<4>(w, a, r0, out, ldo); break;
    case 5: tile2_q4_1_vnni_rb<5>(w, a, r0, out, ldo); break;
    case 6: tile2_q4_1_vnni_rb<6>(w, a, r0, out, ldo); break;
    case 7: tile2_q4_1_vnni_rb<7>(w, a, r0, out, ldo); break;
    default: tile2_q4_1_vnni_rb<8>(w, a, r0, out, ldo); break;
  }
}
#endif

template <int RB>
void tile_q4_1_avx512_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  tile_q4_1_rb<RB, false>(w, a, r0, out, ldo, ncols);
}
template <int RB>
void tile_q8_0_avx512_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  tile_q8_0_rb<RB, false>(w, a, r0, out, ldo, ncols);
}
#if defined(__AVX512VNNI__)
template <int RB>
void tile_q4_1_vnni_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  tile_q4_1_rb<RB, true>(w, a, r0, out, ldo, ncols);
}
template <int RB>
void tile_q8_0_vnni_rb(const uint8_t* w, const Act& a, int r0, float* out, int ldo, int ncols) {
  tile_q8_0_rb<RB, true>(w, a, r0, out, ldo, ncols);
}
#endif

constexpr int kRowBlockAvx512 = 16;

#define TD_RB_SWITCH(NAME) \
  switch (rb) { \
    case 1: NAME<1>(w, a, r0, out, ldo, ncols); break; \
    case 2: NAME<2>(w, a, r0, out, ldo, ncols); break; \
    case 3: NAME<3>(w, a, r0, out, ldo, ncols); break; \
    case 4: NAME<4>(w, a, r0, out, ldo, ncols); break; \
    case 5: NAME<5>(w, a, r0, out, ldo, ncols); break; \
    case 6: NAME<6>(w, a, r0, out, ldo, ncols); break; \
    case 7: NAME<7>(w, a, r0, out, ldo, ncols); break; \
    case 8: NAME<8>(w, a, r0, out, ldo, ncols); break; \
    case 9: NAME<9>(w, a, r0, out, ldo, ncols); break; \
    case 10: NAME<10>(w, a, r0, out, ldo, ncols); break; \
    case 11: NAME<11>(w, a, r0, out, ldo, ncols); break; \
    case 12: NAME<12>(w, a, r0, out, ldo, ncols); break; \
    case 13: NAME<13>(w, a, r0, out, ldo, ncols); break; \
    case 14: NAME<14>(w, a, r0, out, ldo, ncols); break; \
    case 15: NAME<15>(w, a, r0, out, ldo, ncols); break; \
    default: NAME<16>(w, a, r0, out, ldo, ncols); break; \
  }

inline void tile_q4_1_avx512(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                             int ncols) {
  TD_RB_SWITCH(tile_q4_1_avx512_rb)
}

inline void tile_q8_0_avx512(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                             int ncols) {
  TD_RB_SWITCH(tile_q8_0_avx512_rb)
}

#if defined(__AVX512VNNI__)
inline void tile_q4_1_vnni(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo, int ncols) {
  TD_RB_SWITCH(tile_q4_1_vnni_rb)
}

inline void tile_q8_0_vnni(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo, int ncols) {
  TD_RB_SWITCH(tile_q8_0_vnni_rb)
}
#endif

}  // namespace td
#endif

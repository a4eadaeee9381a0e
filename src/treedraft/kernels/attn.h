// Row-invariant decode attention: out (T, nh, hd) = softmax(q k^T * scale) v over each row's
// allowed keys, for exact speculative decoding.
//
// Every (row, head) walks its allowed keys in increasing slot order and reduces with an order
// that depends only on a key's *rank* in that list: online softmax (Milakov & Gimelshein 2018,
// "Online normalizer calculation for softmax") over consecutive chunks of kChunk allowed keys,
// keys of a chunk summed one after another. A tree node whose allowed list is (prefix slots,
// ancestor slots, own slot) therefore sees the same key/value sequence as the plain one-token
// step at that position (cache slots 0..pos) and gets the same bits, whatever T, L or the slots.
//
// Fixed arithmetic on every code path (so avx512 / avx2 / scalar give identical bits):
//   dot(q, k): 16 lane accumulators, lane l sums q[16i+l]*k[16i+l] over i with fma (tail
//              elements hd % 16 go to lanes 0.. with fma), then the lanes are added as a tree
//              (l += l+8, l += l+4, l += l+2, l += l+1); score = dot * scale
//   chunk:     m' = max(m, max score); a = exp(m - m'); l = l*a; acc[d] = acc[d]*a;
//              per key j in order: p = exp(s_j - m'); l = l + p; acc[d] = fma(p, v_j[d], acc[d])
//   output:    acc[d] / l      (a row with no allowed key gives zeros)
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace td {
namespace attn {

constexpr int kChunk = 16;  // allowed keys per online-softmax step

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

#if defined(__AVX2__)
// Lanes l of lo (0..7) and hi (8..15) reduced as the scalar tree: l += l+8, l += l+4, l += l+2, l += l+1.
inline float tree8(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

// The 16 lane sums of q[16i+l]*k[16i+l] (fma, i ascending), tail hd%16 into lanes 0.., reduced
// as a fixed tree.
template <int I>
inline float dot(const float* q, const float* k, int hd) {
  alignas(64) float lane[16];
  const int nv = hd / 16;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < nv; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), _mm512_loadu_ps(k + 16 * i), a);
    if (hd % 16 == 0)  // the lane tree in registers: the same additions of the same operands
      return tree8(_mm512_castps512_ps256(a),
                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    _mm512_store_ps(lane, a);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < nv; ++i) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i), _mm256_loadu_ps(k + 16 * i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i + 8), _mm256_loadu_ps(k + 16 * i + 8), a1);
    }
    if (hd % 16 == 0) return tree8(a0, a1);
    _mm256_store_ps(lane, a0);
    _mm256_store_ps(lane + 8, a1);
  }
#endif
  if constexpr (I == kScalar) {
    for (int l = 0; l < 16; ++l) lane[l] = 0.f;
    for (int i = 0; i < nv; ++i)
      for (int l = 0; l < 16; ++l) lane[l] = std::fma(q[16 * i + l], k[16 * i + l], lane[l]);
  }
  for (int t = 16 * nv; t < hd; ++t) lane[t - 16 * nv] = std::fma(q[t], k[t], lane[t - 16 * nv]);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

// acc[d] = acc[d] * a (elementwise, identical on every path)
template <int I>
inline void scale_acc(float* acc, float a, int hd) {
  int d = 0;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    const __m512 va = _mm512_set1_ps(a);
    for (; d + 16 <= hd; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), va));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    const __m256 va = _mm256_set1_ps(a);
    for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), va));
  }
#endif
  for (; d < hd; ++d) acc[d] = acc[d] * a;
}

// acc[d] = fma(p, v[d], acc[d])
template <int I>
inline void axpy(float* acc, float p, const float* v, int hd) {
  int d = 0;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    const __m512 vp = _mm512_set1_ps(p);
    for (; d + 16 <= hd; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    const __m256 vp = _mm256_set1_ps(p);
    for (; d + 8 <= hd; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < hd; ++d) acc[d] = std::fma(p, v[d], acc[d]);
}

// One (row, head): keys are slots idx[0..n) (or 0..n-1 when idx is null) of k/v with row stride
// ks/vs floats; writes out[0..hd).
template <int I>
void attend_one(const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                const int32_t* idx, int n, int hd, float scale, float* out) {
  thread_local std::vector<float> acc_buf;
  acc_buf.assign(hd, 0.f);
  float* acc = acc_buf.data();
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  float s[kChunk];
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int cn = n - c0 < kChunk ? n - c0 : kChunk;
    float mc = m;
    for (int j = 0; j < cn; ++j) {
      const int64_t slot = idx ? idx[c0 + j] : c0 + j;
      s[j] = dot<I>(q, k + slot * ks, hd) * scale;
      mc = s[j] > mc ? s[j] : mc;
    }
    const float a = std::exp(m - mc);  // exp(-inf) = 0 on the first chunk
    l = l * a;
    scale_acc<I>(acc, a, hd);
    for (int j = 0; j < cn; ++j) {
      const int64_t slot = idx ? idx[c0 + j] : c0 + j;
      const float p = std::exp(s[j] - mc);
      l = l + p;
      axpy<I>(acc, p, v + slot * vs, hd);
    }
    m = mc;
  }
  for (int d = 0; d < hd; ++d) out[d] = n > 0 ? acc[d] / l : 0.f;
}

}  // namespace attn
}  // namespace td

// AVX2 register path of attn.h's chunk_ref for a full chunk of 16 keys (AMD EPYC and other AVX2-only
// CPUs): included by attn.h after chunk_ref. Per query the same operations on the same values as
// chunk_ref<kAvx2>, so the bits equal every other path's.
#pragma once
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace td {
namespace attn {

// The 8 scores dot<kAvx2>(q, k_j) of keys j < 8 (key j at kp[j]), hd = 16 * NV: lanes l (a0) and l + 8
// (a1) accumulate q[16i+l] * k[16i+l] with fma, i ascending; then each key's tree
// (l += l+8, l += l+4, l += l+2, l += l+1) is done for the 8 keys jointly with shuffles: every
// addition adds the same two partial sums as tree8, lane order restored by one permute.
template <int NV, class T>
inline __m256 scores8_avx2(const float* q, const T* const* kp) {
  __m256 b[8];
  for (int j = 0; j < 8; ++j) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int i = 0; i < NV; ++i) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i), load8(kp[j] + 16 * i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i + 8), load8(kp[j] + 16 * i + 8), a1);
    }
    b[j] = _mm256_add_ps(a0, a1);  // (l += l+8)
  }
  __m256 c[4], d[2];
  for (int i = 0; i < 4; ++i)  // (l += l+4): [key 2i: 4 lanes | key 2i+1: 4 lanes]
    c[i] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(b[2 * i], b[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // (l += l+2): [keys 4i, 4i+2: 2 lanes each | keys 4i+1, 4i+3]
    d[i] = _mm256_add_ps(_mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  // (l += l+1): lanes hold keys 0, 2, 4, 6 | 1, 3, 5, 7
  const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], 0x88), _mm256_shuffle_ps(d[0], d[1], 0xDD));
  return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// chunk_ref for a full chunk of 16 keys (key j at kp[j], value at vp[j]) and one query, hd = 16 * NV;
// prefetches the rows of `ahead` (the next chunk, attn_kv.h) along the way.
template <int NV, class T>
inline void chunk16_avx2(const float* q, const T* const* kp, const T* const* vp, float scale, float& m,
                         float& l, float* acc, const Ahead<T>& ahead) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 s0 = _mm256_mul_ps(scores8_avx2<NV>(q, kp), vs);
  const __m256 s1 = _mm256_mul_ps(scores8_avx2<NV>(q, kp + 8), vs);
  alignas(32) float s[16], p[16];
  _mm256_store_ps(s, s0);
  _mm256_store_ps(s + 8, s1);
  float mc = m;
  for (int j = 0; j < 16; ++j) mc = s[j] > mc ? s[j] : mc;
  const float al = exp_fixed(m - mc);
  float lu = l * al;
  const __m256 vm = _mm256_set1_ps(mc);
  _mm256_store_ps(p, exp_fixed8(_mm256_sub_ps(s0, vm)));
  _mm256_store_ps(p + 8, exp_fixed8(_mm256_sub_ps(s1, vm)));
  __m256 av[2 * NV];
  const __m256 va = _mm256_set1_ps(al);
  for (int i = 0; i < 2 * NV; ++i) av[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * i), va);
  for (int j = 0; j < 16; ++j) {
    ahead.row(j, 16 * NV);
    lu = lu + p[j];
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int i = 0; i < 2 * NV; ++i) av[i] = _mm256_fmadd_ps(pj, load8(vp[j] + 8 * i), av[i]);
  }
  for (int i = 0; i < 2 * NV; ++i) _mm256_storeu_ps(acc + 8 * i, av[i]);
  l = lu;
  m = mc;
}

// nq queries through chunk16_avx2 when hd is 16, 32, 64 or 128 (the first one prefetches `ahead`);
// false (nothing done) otherwise.
template <class T>
inline bool chunk16_fast_avx2(int nq, const float* const* q, const T* k, int64_t ks, const T* v,
                              int64_t vs, const int32_t* idx, int c0, int hd, float scale, float* const* m,
                              float* const* l, float* const* acc, Ahead<T> ahead) {
  if (hd != 16 && hd != 32 && hd != 64 && hd != 128) return false;
  const T* kp[16];
  const T* vp[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t slot = idx ? idx[c0 + j] : c0 + j;
    kp[j] = k + slot * ks;
    vp[j] = v + slot * vs;
  }
  for (int i = 0; i < nq; ++i, ahead.k = nullptr) {
    switch (hd) {
      case 16: chunk16_avx2<1>(q[i], kp, vp, scale, *m[i], *l[i], acc[i], ahead); break;
      case 32: chunk16_avx2<2>(q[i], kp, vp, scale, *m[i], *l[i], acc[i], ahead); break;
      case 64: chunk16_avx2<4>(q[i], kp, vp, scale, *m[i], *l[i], acc[i], ahead); break;
      default: chunk16_avx2<8>(q[i], kp, vp, scale, *m[i], *l[i], acc[i], ahead); break;
    }
  }
  return true;
}

}  // namespace attn
}  // namespace td
#endif

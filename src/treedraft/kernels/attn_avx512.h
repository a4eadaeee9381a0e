// AVX-512 register path of attn.h's chunk_ref for a full chunk of 16 keys, and the score kernel
// (scores16) that attn_gemm.h's block GEMM shares: included by attn.h after chunk_ref. Per query the
// same operations on the same values as chunk_ref<kAvx512>, so the bits equal every other path's.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace td {
namespace attn {

// Lane sums of 16 zmm accumulators, each reduced by dot's tree (l += l+8, +4, +2, +1), done jointly
// with shuffles: every addition adds the same two partial sums as tree8 does for that key, so the
// result lanes are bitwise dot<kAvx512>'s values; lane order restored by one permute (kPerm).
inline __m512i reduce16_perm();
inline __m512 reduce16(const __m512* a, bool permute = true) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // (l += l+8): [key 2i: 8 lanes | key 2i+1: 8 lanes]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // (l += l+4): 4 keys x 4 lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // (l += l+2): 8 keys x 2 lanes
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  // (l += l+1): 16 keys x 1 lane
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return permute ? _mm512_permutexvar_ps(reduce16_perm(), e) : e;
}

// Which output lane of the unpermuted reduce16 holds key j, found once by reducing a[j] = j.
inline __m512i reduce16_perm() {
  static const __m512i perm = [] {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_set1_ps((float)j);
    alignas(64) float e[16];
    _mm512_store_ps(e, reduce16(a, false));
    alignas(64) int32_t idx[16];
    for (int lane = 0; lane < 16; ++lane) idx[(int)(e[lane] / 16.f)] = lane;
    return _mm512_load_si512((const void*)idx);
  }();
  return perm;
}

// The 16 scores dot(q, k_j) * scale of a full chunk (key j at kp[j]), hd = 16 * NV, as dot<kAvx512>.
template <int NV, class T>
inline __m512 scores16(const float* q, const T* const* kp, float scale) {
  __m512 qv[NV], a[16];
  for (int i = 0; i < NV; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  for (int j = 0; j < 16; ++j) {
    __m512 t = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i) t = _mm512_fmadd_ps(qv[i], load16(kp[j] + 16 * i), t);
    a[j] = t;
  }
  return _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
}

// The level-c partial sums of reduce16 for keys 4h..4h+3 of Q queries: a[u][j] is key 4h+j's 16
// lanes for query u; out[u] = reduce16's c[h] (the (l += l+8) and (l += l+4) steps of those keys).
template <int Q>
inline void reduce4(const __m512 (*a)[4], __m512* out) {
  for (int u = 0; u < Q; ++u) {
    const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[u][0], a[u][1], 0x44),
                                    _mm512_shuffle_f32x4(a[u][0], a[u][1], 0xEE));
    const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[u][2], a[u][3], 0x44),
                                    _mm512_shuffle_f32x4(a[u][2], a[u][3], 0xEE));
    out[u] = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xDD));
  }
}

// reduce16's (l += l+2) and (l += l+1) steps, then its permute and the scale, for Q queries whose c-level partial
// sums (reduce4's output) are c[h][u] for keys 4h..4h+3: s[u] = the 16 scores of query u.
template <int Q>
inline void reduce16_tail(const __m512 (*c)[Q], float scale, __m512* s) {
  const __m512i perm = reduce16_perm();
  for (int u = 0; u < Q; ++u) {
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_ps(c[0][u], c[1][u], 0x44), _mm512_shuffle_ps(c[0][u], c[1][u], 0xEE));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_ps(c[2][u], c[3][u], 0x44), _mm512_shuffle_ps(c[2][u], c[3][u], 0xEE));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
    s[u] = _mm512_mul_ps(_mm512_permutexvar_ps(perm, e), _mm512_set1_ps(scale));
  }
}

// scores16 for Q queries at once: s[u] = the 16 scores dot(q[u], k_j) * scale. Keys go 4 at a time,
// each key vector loaded (and, for fp16, converted) once for all Q queries; per (query, key) the same
// fma chain as scores16 and per query the same reduce16 additions (its c level per 4 keys, then d, e).
template <int NV, int Q, class T>
inline void scores16_q(const float* const* q, const T* const* kp, float scale, __m512* s) {
  __m512 c[4][Q];
  for (int h = 0; h < 4; ++h) {
    __m512 a[Q][4];
    for (int u = 0; u < Q; ++u)
      for (int j = 0; j < 4; ++j) a[u][j] = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i)
      for (int j = 0; j < 4; ++j) {
        const __m512 kv = load16(kp[4 * h + j] + 16 * i);
        for (int u = 0; u < Q; ++u) a[u][j] = _mm512_fmadd_ps(_mm512_loadu_ps(q[u] + 16 * i), kv, a[u][j]);
      }
    reduce4<Q>(a, c[h]);
  }
  reduce16_tail<Q>(c, scale, s);
}

#if defined(__AVX512BF16__)
// scores16_q in bf16 scores (NV even): per (query, key) dotb's vdpbf16ps chain over the NV / 2 groups of 32, each key
// converted to bf16 once for all Q queries, then reduce16 (its per-accumulator tree is dotb's).
template <int NV, int Q, class T>
inline void scores16_q_bf16(const float* const* q, const T* const* kp, float scale, __m512* s) {
  static_assert(NV % 2 == 0, "bf16 scores need hd % 32 == 0");
  __m512bh qb[Q][NV / 2];
  for (int u = 0; u < Q; ++u)
    for (int i = 0; i < NV / 2; ++i) qb[u][i] = bf16x32(q[u] + 32 * i);
  __m512 c[4][Q];
  for (int h = 0; h < 4; ++h) {  // keys 4 at a time, as scores16_q: reduce4 per group, then d and e per query
    __m512 a[Q][4];
    for (int u = 0; u < Q; ++u)
      for (int j = 0; j < 4; ++j) a[u][j] = _mm512_setzero_ps();
    for (int i = 0; i < NV / 2; ++i)
      for (int j = 0; j < 4; ++j) {
        const __m512bh kb = bf16x32(kp[4 * h + j] + 32 * i);
        for (int u = 0; u < Q; ++u) a[u][j] = _mm512_dpbf16_ps(a[u][j], qb[u][i], kb);
      }
    reduce4<Q>(a, c[h]);
  }
  reduce16_tail<Q>(c, scale, s);
}
#endif

// chunk_ref for a full chunk of 16 keys (key j at kp[j], value at vp[j]) and Q queries at once
// (Q = 1..4: independent queries hide the latency of each one's sequential l / acc chains and share
// the key and value loads), hd = 16 * NV, AVX-512: per query the same operations on the same values
// as chunk_ref. Prefetches the rows of `ahead` (the next chunk) along the way.
template <int NV, int Q, class T>
inline void chunk16_avx512(const float* const* q, const T* const* kp, const T* const* vp, float scale,
                           float* const* m, float* const* l, float* const* acc, const Ahead<T>& ahead) {
  alignas(64) float p[Q][16];
  __m512 av[Q][NV], s[Q];
  float mc[Q];
#if defined(__AVX512BF16__)
  if constexpr (NV % 2 == 0) {
    if (g_bf16_scores) scores16_q_bf16<NV, Q>(q, kp, scale, s);
    else scores16_q<NV, Q>(q, kp, scale, s);
  } else {
    scores16_q<NV, Q>(q, kp, scale, s);
  }
#else
  scores16_q<NV, Q>(q, kp, scale, s);
#endif
  for (int u = 0; u < Q; ++u) {
    const float smax = _mm512_reduce_max_ps(s[u]);
    mc[u] = smax > *m[u] ? smax : *m[u];  // max is exact; a +-0 tie cannot change exp_fixed's value
    const float al = exp_fixed(*m[u] - mc[u]);
    *l[u] = *l[u] * al;
    _mm512_store_ps(p[u], exp_fixed16(_mm512_sub_ps(s[u], _mm512_set1_ps(mc[u]))));
    const __m512 va = _mm512_set1_ps(al);
    for (int i = 0; i < NV; ++i) av[u][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[u] + 16 * i), va);
  }
  float lu[Q];
  for (int u = 0; u < Q; ++u) lu[u] = *l[u];
  for (int j = 0; j < 16; ++j) {
    ahead.row(j, 16 * NV);
    for (int u = 0; u < Q; ++u) lu[u] = lu[u] + p[u][j];
    for (int i = 0; i < NV; ++i) {
      const __m512 vv = load16(vp[j] + 16 * i);
      for (int u = 0; u < Q; ++u) av[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[u][j]), vv, av[u][i]);
    }
  }
  for (int u = 0; u < Q; ++u) {
    *l[u] = lu[u];
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[u] + 16 * i, av[u][i]);
    *m[u] = mc[u];
  }
}

// nq queries through chunk16_avx512 in groups of up to 4 (2 when hd = 128: the accumulators must
// stay in registers); the first group prefetches `ahead`.
template <int NV, class T>
inline void chunk16_group(int nq, const float* const* q, const T* const* kp, const T* const* vp,
                          float scale, float* const* m, float* const* l, float* const* acc, Ahead<T> ahead) {
  constexpr int kQ = NV >= 8 ? 2 : 4;
  int i = 0;
  for (; i + kQ <= nq; i += kQ, ahead.k = nullptr)
    chunk16_avx512<NV, kQ>(q + i, kp, vp, scale, m + i, l + i, acc + i, ahead);
  switch (nq - i) {
    case 3: chunk16_avx512<NV, 3>(q + i, kp, vp, scale, m + i, l + i, acc + i, ahead); break;
    case 2: chunk16_avx512<NV, 2>(q + i, kp, vp, scale, m + i, l + i, acc + i, ahead); break;
    case 1: chunk16_avx512<NV, 1>(q + i, kp, vp, scale, m + i, l + i, acc + i, ahead); break;
    default: break;
  }
}

// nq queries through chunk16_group when hd is 16, 32, 64 or 128; false (nothing done) otherwise.
template <class T>
inline bool chunk16_fast(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                         const int32_t* idx, int c0, int hd, float scale, float* const* m, float* const* l,
                         float* const* acc, const Ahead<T>& ahead) {
  if (hd != 16 && hd != 32 && hd != 64 && hd != 128) return false;
  const T* kp[16];
  const T* vp[16];
  for (int j = 0; j < 16; ++j) {
    const int64_t slot = idx ? idx[c0 + j] : c0 + j;
    kp[j] = k + slot * ks;
    vp[j] = v + slot * vs;
  }
  switch (hd) {
    case 16: chunk16_group<1>(nq, q, kp, vp, scale, m, l, acc, ahead); break;
    case 32: chunk16_group<2>(nq, q, kp, vp, scale, m, l, acc, ahead); break;
    case 64: chunk16_group<4>(nq, q, kp, vp, scale, m, l, acc, ahead); break;
    default: chunk16_group<8>(nq, q, kp, vp, scale, m, l, acc, ahead); break;
  }
  return true;
}

}  // namespace attn
}  // namespace td
#endif

// The shared chunks of one key block for many queries at once, as three small register-blocked GEMM-like
// passes (AVX-512; included by attn.h after chunk16_avx512):
//   1. scores: S[u][j] = dot(q_u, k_j) * scale for every query u and key j of the block's shared chunks,
//      2 queries x 8 keys per inner loop (16 zmm accumulators, each key row loaded once for both queries),
//      reduced by reduce16 (the same lane tree as dot<kAvx512>);
//   2. softmax pieces: per query and chunk, m' = max(m, max s); a = exp(m - m'); l = l * a;
//      p = exp(s - m'); l = l + p_j in key order (the queries' chains interleaved), a kept per chunk;
//   3. P x V: QB queries x hd accumulators in registers for the whole block; per chunk acc = acc * a,
//      then acc = fma(p_j, v_j, acc) in key order, each value row loaded once for the QB queries.
// Per (query, key) and per query these are exactly chunk_ref's operations on the same operands in the
// same order (only the loop nesting across queries and keys changes), so the bits equal every other
// path's whatever the number of queries: a row of a 16-row tree step equals the 1-row step bitwise.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace td {
namespace attn {

constexpr int kGemmMaxQ = 64;  // queries per block_gemm call (= kMaxGroup)
// Fewer queries (a 1-row step's 3 GQA heads of a kv head) stay on chunk_full, which interleaves each
// chunk's key and value reads and measured as fast or faster there (memory-bound); same bits either way.
constexpr int kGemmMinQ = 4;
constexpr int kGemmMaxKeys = 128;  // keys per block_gemm call (= kBlock)
constexpr int kBlockChunksMax = kGemmMaxKeys / 16;

// Scores of queries u0, u0+1 against keys j0..j0+7 (key j at k + j * ks): out lanes 0..7 -> S[u0][j0..],
// lanes 8..15 -> S[u0 + 1][j0..]. Each accumulator is dot<kAvx512>'s 16 lanes (fma, i ascending from 0).
template <int NV, class T>
inline void scores_2x8(const float* q0, const float* q1, const T* k, int64_t ks, float scale, float* s0,
                       float* s1) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (int i = 0; i < NV; ++i) {
    const __m512 x0 = _mm512_loadu_ps(q0 + 16 * i), x1 = _mm512_loadu_ps(q1 + 16 * i);
    for (int j = 0; j < 8; ++j) {
      const __m512 kv = load16(k + j * ks + 16 * i);
      a[j] = _mm512_fmadd_ps(x0, kv, a[j]);
      a[8 + j] = _mm512_fmadd_ps(x1, kv, a[8 + j]);
    }
  }
  const __m512 r = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
  _mm256_storeu_ps(s0, _mm512_castps512_ps256(r));
  _mm256_storeu_ps(s1, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
}

// Pass 1 for nq queries over nk keys (a multiple of 16) starting at k: S row u at s + u * kGemmMaxKeys.
// Keys outer (8 at a time, kept in L1 for every query), query pairs inner; an odd last query (every
// query when hd = 128: its 2 x 8 query registers would not fit) goes 16 keys at a time through scores16.
template <int NV, class T>
inline void gemm_scores_rows(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                             int nk, float scale, float* s, bool prefetch_k) {
  const int npair = NV <= 4 ? nq / 2 * 2 : 0;
  if (npair > 0)
    for (int j0 = 0; j0 < nk; j0 += 8) {
      if (prefetch_k && j0 + 24 <= nk) prefetch_rows(k + (j0 + 16) * ks, ks, 8, 16 * NV);
      if (v != nullptr) prefetch_rows<_MM_HINT_T1>(v + j0 * vs, vs, 8, 16 * NV);  // for pass 3
      for (int u = 0; u < npair; u += 2)
        scores_2x8<NV>(q[u], q[u + 1], k + j0 * ks, ks, scale, s + u * kGemmMaxKeys + j0,
                       s + (u + 1) * kGemmMaxKeys + j0);
    }
  for (int j0 = 0; j0 < nk && npair < nq; j0 += 16) {
    if (npair == 0) {
      if (prefetch_k && j0 + 32 <= nk) prefetch_rows(k + (j0 + 16) * ks, ks, 16, 16 * NV);
      if (v != nullptr) prefetch_rows<_MM_HINT_T1>(v + j0 * vs, vs, 16, 16 * NV);
    }
    const T* kp[16];
    for (int j = 0; j < 16; ++j) kp[j] = k + (j0 + j) * ks;
    for (int u = npair; u < nq; ++u) _mm512_storeu_ps(s + u * kGemmMaxKeys + j0, scores16<NV>(q[u], kp, scale));
  }
}

// From this many queries on, an fp16 block's keys are widened to float32 once per 16-key chunk (4 KB at hd 64,
// in L1) before pass 1, instead of once per query pair: the same float values (the widening is exact), so the
// same bits. On an Ice Lake Xeon, one thread: the pass alone 1.09-1.20x at 18 queries and 1.30-1.37x at 48
// (benchmarks/attn_scores_ab.cpp, cache-resident); in a forward, where the keys come from memory, the step
// 0.99-1.02x at 8 rows (24 queries) and 1.01-1.06x at 16 (48), interleaved (attn_ab.py --compare widen).
constexpr int kWidenMinQ = 36;
// g_widen_keys (attn.h, defined for every build: the Python switch exists on AVX2-only builds too) off: pass 1
// widens per query pair at every count (same bits; for timing A/Bs)

// Pass 1 with each 16-key chunk of an fp16 block widened to float32 once (then gemm_scores_rows on it).
template <int NV>
inline void gemm_scores_widened(int nq, const float* const* q, const half_t* k, int64_t ks, const half_t* v,
                                int64_t vs, int nk, float scale, float* s) {
  alignas(64) float kf[16 * 16 * NV];  // the chunk's 16 keys, row j at kf + j * 16 NV
  for (int j0 = 0; j0 < nk; j0 += 16) {
    if (j0 + 32 <= nk) prefetch_rows(k + (j0 + 16) * ks, ks, 16, 16 * NV);
    prefetch_rows<_MM_HINT_T1>(v + j0 * vs, vs, 16, 16 * NV);  // for pass 3
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < NV; ++i) _mm512_store_ps(kf + (j * NV + i) * 16, load16(k + (j0 + j) * ks + 16 * i));
    gemm_scores_rows<NV, float>(nq, q, kf, 16 * NV, nullptr, 0, 16, scale, s + j0, false);
  }
}

#if defined(__AVX512BF16__)
// Pass 1 in bf16 scores (NV even): the queries converted to bf16 once, each 16-key chunk's keys once; then 2 queries x
// 8 keys per inner loop (an odd last query: 1 x 16), per (query, key) dotb's vdpbf16ps chain, reduce16's tree.
template <int NV, class T>
inline void gemm_scores_bf16(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs, int nk,
                             float scale, float* s) {
  static_assert(NV % 2 == 0, "bf16 scores need hd % 32 == 0");
  constexpr int G = NV / 2;
  __m512bh qb[kGemmMaxQ][G];
  for (int u = 0; u < nq; ++u)
    for (int i = 0; i < G; ++i) qb[u][i] = bf16x32(q[u] + 32 * i);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j0 = 0; j0 < nk; j0 += 16) {
    if (j0 + 32 <= nk) prefetch_rows(k + (j0 + 16) * ks, ks, 16, 16 * NV);
    if (v != nullptr) prefetch_rows<_MM_HINT_T1>(v + j0 * vs, vs, 16, 16 * NV);  // for pass 3
    __m512bh kb[16][G];
    for (int j = 0; j < 16; ++j)
      for (int i = 0; i < G; ++i) kb[j][i] = bf16x32(k + (j0 + j) * ks + 32 * i);
    int u = 0;
    for (; u + 2 <= nq; u += 2)
      for (int h = 0; h < 16; h += 8) {
        __m512 a[16];
        for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
        for (int i = 0; i < G; ++i)
          for (int j = 0; j < 8; ++j) {
            a[j] = _mm512_dpbf16_ps(a[j], qb[u][i], kb[h + j][i]);
            a[8 + j] = _mm512_dpbf16_ps(a[8 + j], qb[u + 1][i], kb[h + j][i]);
          }
        const __m512 r = _mm512_mul_ps(reduce16(a), sc);
        _mm256_storeu_ps(s + u * kGemmMaxKeys + j0 + h, _mm512_castps512_ps256(r));
        _mm256_storeu_ps(s + (u + 1) * kGemmMaxKeys + j0 + h,
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
      }
    for (; u < nq; ++u) {
      __m512 a[16];
      for (int j = 0; j < 16; ++j) {
        a[j] = _mm512_setzero_ps();
        for (int i = 0; i < G; ++i) a[j] = _mm512_dpbf16_ps(a[j], qb[u][i], kb[j][i]);
      }
      _mm512_storeu_ps(s + u * kGemmMaxKeys + j0, _mm512_mul_ps(reduce16(a), sc));
    }
  }
}
#endif

template <int NV, class T>
inline void gemm_scores(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs, int nk,
                        float scale, float* s) {
#if defined(__AVX512BF16__)
  if constexpr (NV % 2 == 0)
    if (g_bf16_scores) return gemm_scores_bf16<NV>(nq, q, k, ks, v, vs, nk, scale, s);
#endif
  if constexpr (std::is_same_v<T, half_t>)
    if (g_widen_keys && nq >= kWidenMinQ) return gemm_scores_widened<NV>(nq, q, k, ks, v, vs, nk, scale, s);
  gemm_scores_rows<NV>(nq, q, k, ks, v, vs, nk, scale, s, true);
}

// In-register transpose of a 16 x 16 tile: r[i] lane j -> r[j] lane i.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], 128-bit lane L: element 4L + e of rows 4i .. 4i + 3
    const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
  }
  __m512 o[16];
  for (int e = 0; e < 4; ++e) {  // column 4L + e = lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512 x0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    o[e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    o[8 + e] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    o[4 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    o[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}

// Pass 2 for queries [u0, u0 + 16) (rows of s past nq are zeros, their lanes unused), 16 queries in the
// lanes of one vector: per chunk the 16 x 16 score tile is transposed, then per query lane
// m' = max(m, max_j s_j); a = exp(m - m'); l = l * a; p_j = exp(s_j - m'); l = l + p_j (j ascending),
// the same operations as chunk16_avx512 per query (max is exact; exp_fixed16 per lane = exp_fixed).
// p goes to pt[j * kGemmMaxQ + u], a to alpha[c * kGemmMaxQ + u].
inline void gemm_softmax16(int u0, int nq, int nc, const float* s, float* pt, float* alpha, float* const* m,
                           float* const* l) {
  alignas(64) float mv[16], lv[16];
  const int nu = nq - u0 < 16 ? nq - u0 : 16;
  for (int u = 0; u < 16; ++u) {
    mv[u] = u < nu ? *m[u0 + u] : -std::numeric_limits<float>::infinity();
    lv[u] = u < nu ? *l[u0 + u] : 0.f;
  }
  __m512 mu = _mm512_load_ps(mv), lu = _mm512_load_ps(lv);
  for (int c = 0; c < nc; ++c) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(s + (u0 + i) * kGemmMaxKeys + 16 * c);
    transpose16(r);  // r[j]: key 16c + j, lane = query
    __m512 mx = r[0];
    for (int j = 1; j < 16; ++j) mx = _mm512_max_ps(mx, r[j]);
    const __m512 mc = _mm512_max_ps(mx, mu);
    const __m512 al = exp_fixed16(_mm512_sub_ps(mu, mc));
    lu = _mm512_mul_ps(lu, al);
    _mm512_storeu_ps(alpha + c * kGemmMaxQ + u0, al);
    for (int j = 0; j < 16; ++j) {
      const __m512 p = exp_fixed16(_mm512_sub_ps(r[j], mc));
      lu = _mm512_add_ps(lu, p);
      _mm512_storeu_ps(pt + (16 * c + j) * kGemmMaxQ + u0, p);
    }
    mu = mc;
  }
  _mm512_store_ps(mv, mu);
  _mm512_store_ps(lv, lu);
  for (int u = 0; u < nu; ++u) *m[u0 + u] = mv[u], *l[u0 + u] = lv[u];
}

// Pass 3 for queries [u0, u0 + QB): acc (QB x hd, in registers) = per chunk acc * a, then fma(p_j, v_j, acc).
template <int NV, int QB, class T>
inline void gemm_pv(int u0, int nc, const T* v, int64_t vs, const float* p, const float* alpha,
                    float* const* acc) {
  __m512 av[QB][NV];
  for (int u = 0; u < QB; ++u)
    for (int i = 0; i < NV; ++i) av[u][i] = _mm512_loadu_ps(acc[u0 + u] + 16 * i);
  for (int c = 0; c < nc; ++c) {
    for (int u = 0; u < QB; ++u) {
      const __m512 va = _mm512_set1_ps(alpha[c * kGemmMaxQ + u0 + u]);
      for (int i = 0; i < NV; ++i) av[u][i] = _mm512_mul_ps(av[u][i], va);
    }
    for (int j = 16 * c; j < 16 * c + 16; ++j) {
      const T* vj = v + j * vs;
      for (int i = 0; i < NV; ++i) {
        const __m512 vv = load16(vj + 16 * i);
        for (int u = 0; u < QB; ++u)
          av[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * kGemmMaxQ + u0 + u]), vv, av[u][i]);
      }
    }
  }
  for (int u = 0; u < QB; ++u)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[u0 + u] + 16 * i, av[u][i]);
}

// gemm_pv for queries [u0, u0 + n), n < QB, one instantiation per remainder size
template <int NV, int QB, class T>
inline void gemm_pv_tail(int n, int u0, int nc, const T* v, int64_t vs, const float* p, const float* alpha,
                         float* const* acc) {
  if constexpr (QB > 1) {
    if (n == QB - 1) return gemm_pv<NV, QB - 1>(u0, nc, v, vs, p, alpha, acc);
    gemm_pv_tail<NV, QB - 1>(n, u0, nc, v, vs, p, alpha, acc);
  }
}

// Keys [0, 16 nc) at k + j * ks / v + j * vs (contiguous slots, the same for every query) for nq <= kGemmMaxQ
// queries continuing from their states (m, l, acc), hd = 16 * NV, nc <= kBlockChunksMax.
template <int NV, class T>
inline void block_gemm(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                       int nc, float scale, float* const* m, float* const* l, float* const* acc) {
  alignas(64) float s[(kGemmMaxQ + 15) * kGemmMaxKeys];  // scores, row per query
  alignas(64) float pt[kGemmMaxKeys * kGemmMaxQ];  // softmax weights, row per key
  alignas(64) float alpha[kBlockChunksMax * kGemmMaxQ];  // per chunk rescale factors, row per chunk
  gemm_scores<NV>(nq, q, k, ks, v, vs, 16 * nc, scale, s);
  for (int u = nq; u < (nq + 15) / 16 * 16; ++u)  // padding rows of the last 16-query tile
    for (int j = 0; j < 16 * nc; ++j) s[u * kGemmMaxKeys + j] = 0.f;
  for (int u = 0; u < nq; u += 16) gemm_softmax16(u, nq, nc, s, pt, alpha, m, l);
  int u = 0;
  constexpr int QB = NV >= 8 ? 3 : NV >= 4 ? 6 : 8;  // QB x NV accumulators <= 24 zmm
  for (; u + QB <= nq; u += QB) gemm_pv<NV, QB>(u, nc, v, vs, pt, alpha, acc);
  if (u < nq) gemm_pv_tail<NV, QB>(nq - u, u, nc, v, vs, pt, alpha, acc);
}

// block_gemm when hd is 16, 32, 64 or 128; false (nothing done) otherwise.
template <class T>
inline bool block_gemm_any(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                           int nc, int hd, float scale, float* const* m, float* const* l, float* const* acc) {
  switch (hd) {
    case 16: block_gemm<1>(nq, q, k, ks, v, vs, nc, scale, m, l, acc); return true;
    case 32: block_gemm<2>(nq, q, k, ks, v, vs, nc, scale, m, l, acc); return true;
    case 64: block_gemm<4>(nq, q, k, ks, v, vs, nc, scale, m, l, acc); return true;
    case 128: block_gemm<8>(nq, q, k, ks, v, vs, nc, scale, m, l, acc); return true;
    default: return false;
  }
}

}  // namespace attn
}  // namespace td
#endif

// Attention score pass, one kv head (hd 64, fp16 keys, 512 keys), one thread, hot caches: today's row-invariant
// lane-tree dot (attn_avx512.h scores16_q for a 1-row step's 3 queries, attn_gemm.h gemm_scores for a 16-row
// tree's 48) against a sequential-over-d dot with keys in the vector lanes (a 16-key chunk transposed) or the
// queries in the lanes (4 keys x 48 queries register blocks); checks that the new forms give the scalar bits.
// Session 16 (benchmarks/results/session16.md): 3 queries 3.1 vs 5.6 us, 48 queries 49.4 vs 44.2 us.
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 -Isrc/treedraft/kernels \
//       benchmarks/scores_layout_micro.cpp -o /tmp/scores_micro && /tmp/scores_micro [reps]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "attn.h"

using namespace td::attn;
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int HD = 64, NV = 4;

// 16 keys (rows of 64 fp16 at kp[j]) -> kt[d * 16 + j] fp32
static inline void transpose_chunk(const half_t* const* kp, float* kt) {
  // per 16-d block: 16 keys x 16 d as 16 zmm (converted), transposed in registers
  for (int b = 0; b < 4; ++b) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = load16(kp[j] + 16 * b);
    transpose16(r);  // r[d]: lane j = key j
    for (int d = 0; d < 16; ++d) _mm512_store_ps(kt + (16 * b + d) * 16, r[d]);
  }
}

// Q queries x 16 keys, sequential over d: s[u] lane j = sum_d q_u[d] k_j[d] (fma chain from 0), * scale
template <int Q>
static inline void scores_keys_in_lanes(const float* const* q, const float* kt, float scale, __m512* s) {
  __m512 a[Q];
  for (int u = 0; u < Q; ++u) a[u] = _mm512_setzero_ps();
  for (int d = 0; d < HD; ++d) {
    const __m512 kv = _mm512_load_ps(kt + d * 16);
    for (int u = 0; u < Q; ++u) a[u] = _mm512_fmadd_ps(_mm512_set1_ps(q[u][d]), kv, a[u]);
  }
  for (int u = 0; u < Q; ++u) s[u] = _mm512_mul_ps(a[u], _mm512_set1_ps(scale));
}

// queries in lanes: qt[d * 16 * QV + 16 v + l] = query (16 v + l)'s element d; keys fp32 rows kf[j * 64 + d]
// out st[j * 16 * QV + ...] = scores of key j for the 16 QV queries. 4 keys x QV vectors per register block.
template <int QV>
static inline void scores_queries_in_lanes(const float* qt, const float* kf, int nk, float scale, float* st) {
  for (int j0 = 0; j0 < nk; j0 += 4) {
    __m512 a[4][QV];
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < QV; ++v) a[j][v] = _mm512_setzero_ps();
    for (int d = 0; d < HD; ++d) {
      __m512 qv[QV];
      for (int v = 0; v < QV; ++v) qv[v] = _mm512_load_ps(qt + (d * QV + v) * 16);
      for (int j = 0; j < 4; ++j) {
        const __m512 kb = _mm512_set1_ps(kf[(j0 + j) * HD + d]);
        for (int v = 0; v < QV; ++v) a[j][v] = _mm512_fmadd_ps(qv[v], kb, a[j][v]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < QV; ++v) _mm512_store_ps(st + ((j0 + j) * QV + v) * 16, _mm512_mul_ps(a[j][v], sc));
  }
}

int main(int argc, char** argv) {
  const int nk = 512, reps = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  std::vector<half_t> K(nk * HD);
  for (auto& x : K) x = f32_to_half(nd(g));
  const int NQ = 48;
  std::vector<float> Q(NQ * HD);
  for (auto& x : Q) x = nd(g);
  const float scale = 0.125f;
  const float* qp[NQ];
  for (int u = 0; u < NQ; ++u) qp[u] = &Q[u * HD];
  alignas(64) static float kt[HD * 16], sink[1 << 16];
  volatile float vs = 0;

  // ---- few queries (1-row step: 3 per kv head) ----
  for (int round = 0; round < 3; ++round) {
    double t0 = now();
    for (int r = 0; r < reps; ++r)
      for (int c = 0; c < nk / 16; ++c) {
        const half_t* kp[16];
        for (int j = 0; j < 16; ++j) kp[j] = &K[(16 * c + j) * HD];
        __m512 s[3];
        scores16_q<NV, 3>(qp, kp, scale, s);
        vs = vs + _mm512_reduce_add_ps(_mm512_add_ps(s[0], _mm512_add_ps(s[1], s[2])));
      }
    double t1 = now();
    for (int r = 0; r < reps; ++r)
      for (int c = 0; c < nk / 16; ++c) {
        const half_t* kp[16];
        for (int j = 0; j < 16; ++j) kp[j] = &K[(16 * c + j) * HD];
        transpose_chunk(kp, kt);
        __m512 s[3];
        scores_keys_in_lanes<3>(qp, kt, scale, s);
        vs = vs + _mm512_reduce_add_ps(_mm512_add_ps(s[0], _mm512_add_ps(s[1], s[2])));
      }
    double t2 = now();
    std::printf("few (3 q x 512 keys): lane-tree %.2f us, keys-in-lanes %.2f us\n", (t1 - t0) / reps * 1e6,
                (t2 - t1) / reps * 1e6);
  }
  // ---- many queries (16-row tree: 48 per kv head), 128-key blocks ----
  alignas(64) static float S[(64 + 15) * 128], qt[HD * NQ], kf[128 * HD];
  for (int round = 0; round < 3; ++round) {
    double t0 = now();
    for (int r = 0; r < reps / 4; ++r)
      for (int b = 0; b < nk / 128; ++b) {
        gemm_scores<NV>(NQ, qp, &K[b * 128 * HD], HD, &K[0], HD, 128, scale, S);
        vs = vs + S[r % 100];
      }
    double t1 = now();
    for (int r = 0; r < reps / 4; ++r) {
      for (int u = 0; u < NQ; ++u)  // Q^T once per step (all blocks)
        for (int d = 0; d < HD; ++d) qt[d * NQ + u] = Q[u * HD + d];
      for (int b = 0; b < nk / 128; ++b) {
        for (int j = 0; j < 128; ++j)
          for (int i = 0; i < NV; ++i) _mm512_store_ps(&kf[j * HD + 16 * i], load16(&K[(b * 128 + j) * HD + 16 * i]));
        scores_queries_in_lanes<3>(qt, kf, 128, scale, sink);
        vs = vs + sink[r % 100];
      }
    }
    double t2 = now();
    std::printf("many (48 q x 512 keys): lane-tree GEMM %.2f us, queries-in-lanes %.2f us\n",
                (t1 - t0) / (reps / 4) * 1e6, (t2 - t1) / (reps / 4) * 1e6);
  }
  // ---- the new forms agree bitwise: key 37 query 5 ----
  {
    const half_t* kp[16];
    for (int j = 0; j < 16; ++j) kp[j] = &K[(32 + j) * HD];
    transpose_chunk(kp, kt);
    const float* q5[1] = {qp[5]};
    __m512 s[1];
    scores_keys_in_lanes<1>(q5, kt, scale, s);
    alignas(64) float l[16];
    _mm512_store_ps(l, s[0]);
    for (int u = 0; u < NQ; ++u)
      for (int d = 0; d < HD; ++d) qt[d * NQ + u] = Q[u * HD + d];
    for (int j = 0; j < 128; ++j)
      for (int d = 0; d < HD; ++d) kf[j * HD + d] = to_f32(K[j * HD + d]);
    scores_queries_in_lanes<3>(qt, kf, 128, scale, sink);
    float ref = 0.f;
    for (int d = 0; d < HD; ++d) ref = std::fma(Q[5 * HD + d], to_f32(K[37 * HD + d]), ref);
    ref = ref * scale;
    std::printf("bitwise: keys-in-lanes %.9g queries-in-lanes %.9g scalar %.9g equal=%d\n", l[5], sink[37 * 48 + 5],
                ref, l[5] == ref && sink[37 * 48 + 5] == ref);
  }
  return vs == 12345.f;
}

// bf16 attention arithmetic on this CPU, three checks (session 35; AVX512-BF16 builds only):
//   scores: the q.k pass for nq queries x 1024 keys x hd 64, fp16 keys widened + fp32 FMA (kernels/attn_gemm.h's
//           2 queries x 8 keys form) against bf16 keys + vdpbf16ps (q rounded to bf16), ns per (query, key);
//   pv:     the P x V pass, fp16 values + fp32 FMA (gemm_pv, 6 queries) against values in key-pair interleaved bf16 +
//           vdpbf16ps (p rounded to bf16);
//   sem:    what vdpbf16ps computes per lane: (acc + a1 b1) + a0 b0 with two roundings (the SDM's order) or another
//           order, on 3.2 M random lanes (kernels/attn.h dotb_ref emulates the order found here).
// One thread, operands hot in L1/L2: the passes' own cost, not a forward's.
//
//   g++ -O3 -march=native -ffp-contract=off -std=c++17 benchmarks/attn_bf16_micro.cpp -o /tmp/abf && /tmp/abf
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>
using clk = std::chrono::steady_clock;
static uint16_t bf(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}
static float f(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

static inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// fp16 keys, 2 queries x 8 keys
static void scores_f16(int nq, const float* q, const uint16_t* k, int nk, float* s) {
  for (int j0 = 0; j0 < nk; j0 += 8)
    for (int u = 0; u < nq; u += 2) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        const __m512 x0 = _mm512_loadu_ps(q + u * 64 + 16 * i), x1 = _mm512_loadu_ps(q + (u + 1) * 64 + 16 * i);
        for (int j = 0; j < 8; ++j) {
          const __m512 kv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(k + (j0 + j) * 64 + 16 * i)));
          a[j] = _mm512_fmadd_ps(x0, kv, a[j]);
          a[8 + j] = _mm512_fmadd_ps(x1, kv, a[8 + j]);
        }
      }
      const __m512 r = reduce16(a);
      _mm512_storeu_ps(s + (size_t)u * nk + j0, r);  // (layout irrelevant for timing)
    }
}

// bf16 keys and queries, 2 queries x 8 keys, vdpbf16ps: 2 per (q, k) for hd 64
static void scores_bf16(int nq, const uint16_t* qb, const uint16_t* k, int nk, float* s) {
  for (int j0 = 0; j0 < nk; j0 += 8)
    for (int u = 0; u < nq; u += 2) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int i = 0; i < 2; ++i) {
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(qb + u * 64 + 32 * i);
        const __m512bh x1 = (__m512bh)_mm512_loadu_si512(qb + (u + 1) * 64 + 32 * i);
        for (int j = 0; j < 8; ++j) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + (j0 + j) * 64 + 32 * i);
          a[j] = _mm512_dpbf16_ps(a[j], x0, kv);
          a[8 + j] = _mm512_dpbf16_ps(a[8 + j], x1, kv);
        }
      }
      const __m512 r = reduce16(a);
      _mm512_storeu_ps(s + (size_t)u * nk + j0, r);
    }
}

// bf16, 4 queries x 4 keys (fewer key loads per dp)
static void scores_bf16_4x4(int nq, const uint16_t* qb, const uint16_t* k, int nk, float* s) {
  for (int j0 = 0; j0 < nk; j0 += 4)
    for (int u = 0; u + 4 <= nq; u += 4) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
      for (int i = 0; i < 2; ++i) {
        __m512bh x[4];
        for (int v = 0; v < 4; ++v) x[v] = (__m512bh)_mm512_loadu_si512(qb + (u + v) * 64 + 32 * i);
        for (int j = 0; j < 4; ++j) {
          const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + (j0 + j) * 64 + 32 * i);
          for (int v = 0; v < 4; ++v) a[4 * v + j] = _mm512_dpbf16_ps(a[4 * v + j], x[v], kv);
        }
      }
      _mm512_storeu_ps(s + (size_t)u * nk + j0, reduce16(a));
    }
}

template <int QB>
static void pv_f16(int u0, const uint16_t* v, int nk, const float* p /* [j][64 q] */, float* acc /* [q][64] */) {
  __m512 av[QB][4];
  for (int u = 0; u < QB; ++u) for (int i = 0; i < 4; ++i) av[u][i] = _mm512_loadu_ps(acc + (u0 + u) * 64 + 16 * i);
  for (int j = 0; j < nk; ++j) {
    for (int i = 0; i < 4; ++i) {
      const __m512 vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(v + j * 64 + 16 * i)));
      for (int u = 0; u < QB; ++u) av[u][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * 64 + u0 + u]), vv, av[u][i]);
    }
  }
  for (int u = 0; u < QB; ++u) for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + (u0 + u) * 64 + 16 * i, av[u][i]);
}
// vi: key pairs interleaved: pair c, dim d -> vi[c*128 + 2d + {0,1}] = v[2c][d], v[2c+1][d]; pp: p pairs as uint32
template <int QB>
static void pv_bf16(int u0, const uint16_t* vi, int nk, const uint32_t* pp /* [pair][64 q] */, float* acc) {
  __m512 av[QB][4];
  for (int u = 0; u < QB; ++u) for (int i = 0; i < 4; ++i) av[u][i] = _mm512_loadu_ps(acc + (u0 + u) * 64 + 16 * i);
  for (int c = 0; c < nk / 2; ++c) {
    for (int i = 0; i < 4; ++i) {  // 16 dims x 2 keys = 32 bf16 = one zmm
      const __m512bh vv = (__m512bh)_mm512_loadu_si512(vi + c * 128 + 32 * i);
      for (int u = 0; u < QB; ++u)
        av[u][i] = _mm512_dpbf16_ps(av[u][i], (__m512bh)_mm512_set1_epi32((int)pp[c * 64 + u0 + u]), vv);
    }
  }
  for (int u = 0; u < QB; ++u) for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + (u0 + u) * 64 + 16 * i, av[u][i]);
}

static void bench_scores() {
  const int nk = 1024;
  std::mt19937 g(0);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> kh(nk * 64), kb(nk * 64), qb(48 * 64);
  std::vector<float> q(48 * 64), s(48 * nk + 64);
  for (auto& x : q) x = nd(g);
  for (int i = 0; i < nk * 64; ++i) {
    const float v = nd(g);
    kh[i] = _cvtss_sh(v, 0);
    kb[i] = bf(v);
  }
  for (int i = 0; i < 48 * 64; ++i) qb[i] = bf(q[i]);
  for (int nq : {4, 12, 24, 48}) {
    double best[3] = {1e9, 1e9, 1e9};
    for (int rep = 0; rep < 200; ++rep) {
      auto t0 = clk::now();
      scores_f16(nq, q.data(), kh.data(), nk, s.data());
      auto t1 = clk::now();
      scores_bf16(nq, qb.data(), kb.data(), nk, s.data());
      auto t2 = clk::now();
      scores_bf16_4x4(nq, qb.data(), kb.data(), nk, s.data());
      auto t3 = clk::now();
      best[0] = std::min(best[0], std::chrono::duration<double>(t1 - t0).count());
      best[1] = std::min(best[1], std::chrono::duration<double>(t2 - t1).count());
      best[2] = std::min(best[2], std::chrono::duration<double>(t3 - t2).count());
    }
    const double per = 1e9 / (double(nq) * nk);
    printf("scores nq %2d: fp16+fma %.3f ns/(q,k), bf16 2x8 %.3f, bf16 4x4 %.3f -> %.2fx / %.2fx\n", nq, best[0] * per,
           best[1] * per, best[2] * per, best[0] / best[1], best[0] / best[2]);
  }
}

static void bench_pv() {
  const int nk = 1024;
  std::mt19937 g(0);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0, 1);
  std::vector<uint16_t> vh(nk * 64), vi(nk * 64);
  std::vector<float> p(nk * 64), acc(64 * 64);
  std::vector<uint32_t> pp(nk / 2 * 64);
  for (int j = 0; j < nk; ++j)
    for (int d = 0; d < 64; ++d) {
      const float x = nd(g);
      vh[j * 64 + d] = _cvtss_sh(x, 0);
      vi[(j / 2) * 128 + 2 * d + (j & 1)] = bf(x);
    }
  for (auto& x : p) x = ud(g);
  for (int c = 0; c < nk / 2; ++c)
    for (int u = 0; u < 64; ++u)
      pp[c * 64 + u] = bf(p[2 * c * 64 + u]) | ((uint32_t)bf(p[(2 * c + 1) * 64 + u]) << 16);
  for (int nq : {6, 12, 24, 48}) {
    double b0 = 1e9, b1 = 1e9;
    for (int rep = 0; rep < 200; ++rep) {
      auto t0 = clk::now();
      for (int u = 0; u < nq; u += 6) pv_f16<6>(u, vh.data(), nk, p.data(), acc.data());
      auto t1 = clk::now();
      for (int u = 0; u < nq; u += 6) pv_bf16<6>(u, vi.data(), nk, pp.data(), acc.data());
      auto t2 = clk::now();
      b0 = std::min(b0, std::chrono::duration<double>(t1 - t0).count());
      b1 = std::min(b1, std::chrono::duration<double>(t2 - t1).count());
    }
    const double per = 1e9 / (double(nq) * nk);
    printf("pv     nq %2d: fp16+fma %.3f ns/(q,k), bf16 pairs %.3f -> %.2fx\n", nq, b0 * per, b1 * per, b0 / b1);
  }
}

static void check_semantics() {
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-20, 20);
  long n = 0, sdm = 0, rev = 0, pairsum = 0, one = 0;
  for (int it = 0; it < 200000; ++it) {
    alignas(64) uint16_t a[32], b[32];
    alignas(64) float acc[16], out[16];
    for (int i = 0; i < 32; ++i) {
      a[i] = bf(std::ldexp(nd(g), ex(g)));
      b[i] = bf(std::ldexp(nd(g), ex(g)));
    }
    for (int i = 0; i < 16; ++i) acc[i] = std::ldexp(nd(g), ex(g));
    _mm512_store_ps(out, _mm512_dpbf16_ps(_mm512_load_ps(acc), (__m512bh)_mm512_load_si512(a),
                                          (__m512bh)_mm512_load_si512(b)));
    for (int l = 0; l < 16; ++l) {
      const float p0 = f(a[2 * l]) * f(b[2 * l]), p1 = f(a[2 * l + 1]) * f(b[2 * l + 1]);  // exact products
      ++n;
      sdm += out[l] == (acc[l] + p1) + p0;
      rev += out[l] == (acc[l] + p0) + p1;
      pairsum += out[l] == acc[l] + (p0 + p1);
      one += out[l] == (float)((double)acc[l] + (double)p0 + (double)p1);
    }
  }
  printf("vdpbf16ps on %ld lanes equals: (acc+p1)+p0 %ld, (acc+p0)+p1 %ld, acc+(p0+p1) %ld, one rounding %ld\n", n,
         sdm, rev, pairsum, one);
}

int main() {
  bench_scores();
  bench_pv();
  check_semantics();
}

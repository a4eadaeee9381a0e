// Row-invariant decode attention: out (T, nh, hd) = softmax(q k^T * scale) v over each row's
// allowed keys, for exact speculative decoding.
//
// Every (row, head) walks its allowed keys in increasing slot order and reduces with an order
// that depends only on a key's *rank* in that list: the ranks are cut into blocks of kBlock (128);
// each block runs online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for
// softmax") from a fresh state over consecutive chunks of kChunk (16) keys, keys of a chunk summed
// one after another; the block states are then folded in block order (the split-K combine of
// flash-decoding, Dao et al. 2023, with a fixed split). A tree node whose allowed list is (prefix
// slots, ancestor slots, own slot) therefore sees the same key/value sequence as the plain
// one-token step at that position (cache slots 0..pos) and gets the same bits, whatever T, L, the
// slots, or how attn_sched.h spreads the blocks over threads.
//
// Fixed arithmetic on every code path (so avx512 / avx2 / scalar give identical bits):
//   dot(q, k): 16 lane accumulators, lane l sums q[16i+l]*k[16i+l] over i with fma (tail
//              elements hd % 16 go to lanes 0.. with fma), then the lanes are added as a tree
//              (l += l+8, l += l+4, l += l+2, l += l+1); score = dot * scale
//   block:     m = -inf, l = 0, acc = 0; per chunk of the block:
//              m' = max(m, max score); a = exp(m - m'); l = l*a; acc[d] = acc[d]*a;
//              per key j in order: p = exp(s_j - m'); l = l + p; acc[d] = fma(p, v_j[d], acc[d])
//              (exp = exp_fixed below, vectorized over the chunk with the same operations)
//   fold:      from (m, l, acc) = (-inf, 0, 0), per block b in order: m' = max(m, m_b);
//              a = exp(m - m'); c = exp(m_b - m'); l = fma(l_b, c, l*a); acc = fma(acc_b, c, acc*a)
//   output:    acc[d] / l      (a row with no allowed key gives zeros; one block: its own acc / l)
// bf16 scores (a per-call mode, g_bf16_scores; hd % 32 == 0): dot is replaced by dotb below (q and k rounded to
// bf16, vdpbf16ps' pair order); the AVX-512 path runs the instruction, the scalar and AVX2 paths emulate it, so the
// paths still give identical bits, and so do a row's one-row and tree steps. Everything else above is unchanged.
#pragma once
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "attn_kv.h"  // half_t keys/values: to_f32, load16, load8, prefetch_rows

namespace td {
namespace attn {

constexpr int kChunk = 16;  // allowed keys per online-softmax step

// bf16 scores (a per-call mode, set by Runner::run for its pool's work; serialized like every kernel call): each
// score is dotb below instead of dot. Only where hd % 32 == 0; the AVX-512 path needs an AVX512-BF16 build
// (bf16_scores_supported), the scalar path (and AVX2, which takes it) emulates the instruction bit for bit.
inline bool g_bf16_scores = false;
inline bool bf16_on(int hd) { return g_bf16_scores && hd % 32 == 0; }
inline bool bf16_scores_supported();  // below: an AVX512-BF16 build whose instruction matches dotb_ref

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// exp(x) with fixed operations so the scalar and vector forms give the same bits (range reduction
// x = n ln2 + r, degree-6 Taylor polynomial of e^r by Horner with fma, times 2^n; x < kExpMin -> 0,
// so exp(-inf) = 0). About 2 ulp; softmax weights only need to be the same on every path.
constexpr float kExpMin = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kC[7] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};

inline float exp_fixed(float x) {
  if (!(x >= kExpMin)) return 0.f;
  const float xc = x < 88.f ? x : 88.f;
  const float n = std::nearbyint(xc * kLog2e);
  float r = std::fma(n, -kLn2Hi, xc);
  r = std::fma(n, -kLn2Lo, r);
  float p = kC[0];
  for (int i = 1; i < 7; ++i) p = std::fma(p, r, kC[i]);
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#if defined(__AVX512F__)
inline __m512 exp_fixed16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kC[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC[i]));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(e));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_fixed8(__m256 x) {
  const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_GE_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kC[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// p[j] = exp_fixed(s[j] - m) for j < 16 (s padded by the caller)
template <int I>
inline void exp_chunk(const float* s, float m, float* p) {
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    _mm512_storeu_ps(p, exp_fixed16(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m))));
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    const __m256 vm = _mm256_set1_ps(m);
    _mm256_storeu_ps(p, exp_fixed8(_mm256_sub_ps(_mm256_loadu_ps(s), vm)));
    _mm256_storeu_ps(p + 8, exp_fixed8(_mm256_sub_ps(_mm256_loadu_ps(s + 8), vm)));
    return;
  }
#endif
  for (int j = 0; j < kChunk; ++j) p[j] = exp_fixed(s[j] - m);
}

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
template <int I, class T = float>
inline float dot(const float* q, const T* k, int hd) {
  alignas(64) float lane[16];
  const int nv = hd / 16;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < nv; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), load16(k + 16 * i), a);
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
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i), load8(k + 16 * i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 16 * i + 8), load8(k + 16 * i + 8), a1);
    }
    if (hd % 16 == 0) return tree8(a0, a1);
    _mm256_store_ps(lane, a0);
    _mm256_store_ps(lane + 8, a1);
  }
#endif
  if constexpr (I == kScalar) {
    for (int l = 0; l < 16; ++l) lane[l] = 0.f;
    for (int i = 0; i < nv; ++i)
      for (int l = 0; l < 16; ++l) lane[l] = std::fma(q[16 * i + l], to_f32(k[16 * i + l]), lane[l]);
  }
  for (int t = 16 * nv; t < hd; ++t) lane[t - 16 * nv] = std::fma(q[t], to_f32(k[t]), lane[t - 16 * nv]);
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

// x rounded to bfloat16 (nearest even), as a float; zeros and subnormals -> signed zero and infinities kept, as
// vcvtne2ps2bf16 does (its inputs' subnormals read as zero); a NaN stays a NaN.
inline float round_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t e = b & 0x7f800000u;
  if (e == 0) b &= 0x80000000u;
  else if (e == 0x7f800000u) b = (b & 0x7fffffu) ? ((b | 0x400000u) & 0xffff0000u) : b;
  else b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &b, 4);
  return x;
}

// A result vdpbf16ps would flush: subnormal -> signed zero.
inline float ftz(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x; }

// The bf16 score dot (hd % 32 == 0): q and k rounded to bf16; lane l (of 16) sums, for each 32-element group i,
// q[32i+2l+1] k[32i+2l+1] then q[32i+2l] k[32i+2l] into its accumulator (vdpbf16ps: the products are exact, each
// addition rounds; this order matched the instruction on all 3.2 M lanes tried on a Zen 4), then the lanes are
// added as dot's tree. Scalar form: every path's reference (attn_avx512.h runs it with the instruction).
template <class T>
inline float dotb_ref(const float* q, const T* k, int hd) {
  float lane[16];
  for (int l = 0; l < 16; ++l) lane[l] = 0.f;
  for (int i = 0; i < hd / 32; ++i)
    for (int l = 0; l < 16; ++l) {
      const int o = 32 * i + 2 * l;
      float a = ftz(std::fma(round_bf16(q[o + 1]), round_bf16(to_f32(k[o + 1])), lane[l]));
      lane[l] = ftz(std::fma(round_bf16(q[o]), round_bf16(to_f32(k[o])), a));
    }
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lane[l] = lane[l] + lane[l + w];
  return lane[0];
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 32 floats at p (as 2 x 16) -> 32 bf16 in element order (round to nearest even)
inline __m512bh bf16x32(const float* p) {
  return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
}
inline __m512bh bf16x32(const half_t* p) { return _mm512_cvtne2ps_pbh(load16(p + 16), load16(p)); }
#endif

// Whether the AVX-512 path has bf16 scores: an AVX512-BF16 build on a CPU whose vdpbf16ps gives dotb_ref's bits,
// checked once on 4,096 lanes of random operands (3 to 30 binades apart) against the scalar emulation. The order was
// found on a Zen 4; a CPU that sums the pairs otherwise keeps float32 scores rather than two kinds of bits.
inline bool bf16_scores_supported() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  static const bool ok = [] {
    uint64_t x = 0x9E3779B97F4A7C15ull;
    auto rnd = [&x](int spread) {  // a float with a random sign, mantissa and exponent in [-spread, spread)
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const uint32_t r = (uint32_t)(x >> 32);
      const int e = 127 + (int)(r % (2u * spread)) - spread;
      const uint32_t b = (r & 0x80000000u) | ((uint32_t)e << 23) | ((r >> 5) & 0x7fffffu);
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    };
    for (int it = 0; it < 256; ++it) {
      alignas(64) float q[32], k[32], acc[16], out[16];
      const int spread = 3 + it % 28;
      for (int i = 0; i < 32; ++i) q[i] = round_bf16(rnd(spread)), k[i] = round_bf16(rnd(spread));
      for (int l = 0; l < 16; ++l) acc[l] = rnd(spread);
      _mm512_store_ps(out, _mm512_dpbf16_ps(_mm512_load_ps(acc), _mm512_cvtne2ps_pbh(_mm512_load_ps(q + 16), _mm512_load_ps(q)),
                                            _mm512_cvtne2ps_pbh(_mm512_load_ps(k + 16), _mm512_load_ps(k))));
      for (int l = 0; l < 16; ++l) {
        const float a = ftz(std::fma(q[2 * l + 1], k[2 * l + 1], acc[l]));
        const float want = ftz(std::fma(q[2 * l], k[2 * l], a));
        if (std::memcmp(&want, &out[l], 4) != 0) return false;
      }
    }
    return true;
  }();
  return ok;
#else
  return false;
#endif
}

template <int I, class T>
inline float dotb(const float* q, const T* k, int hd) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (I == kAvx512) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < hd / 32; ++i) a = _mm512_dpbf16_ps(a, bf16x32(q + 32 * i), bf16x32(k + 32 * i));
    return tree8(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
#endif
  return dotb_ref(q, k, hd);
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
template <int I, class T>
inline void axpy(float* acc, float p, const T* v, int hd) {
  int d = 0;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    const __m512 vp = _mm512_set1_ps(p);
    for (; d + 16 <= hd; d += 16)
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(vp, load16(v + d), _mm512_loadu_ps(acc + d)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    const __m256 vp = _mm256_set1_ps(p);
    for (; d + 8 <= hd; d += 8)
      _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(vp, load8(v + d), _mm256_loadu_ps(acc + d)));
  }
#endif
  for (; d < hd; ++d) acc[d] = std::fma(p, to_f32(v[d]), acc[d]);
}

// One online-softmax step over keys j = 0..cn-1 at k + slot_j * ks (slot_j = idx[c0 + j], or c0 + j
// when idx is null) for query q; (m, l, acc) is the query's running state. The reference arithmetic.
template <int I, class T>
inline void chunk_ref(const float* q, const T* k, int64_t ks, const T* v, int64_t vs,
                      const int32_t* idx, int c0, int cn, int hd, float scale, float& m, float& l,
                      float* acc) {
  alignas(64) float s[kChunk], p[kChunk];
  float mc = m;
  for (int j = 0; j < cn; ++j) {
    const int64_t slot = idx ? idx[c0 + j] : c0 + j;
    s[j] = (bf16_on(hd) ? dotb<I>(q, k + slot * ks, hd) : dot<I>(q, k + slot * ks, hd)) * scale;
    mc = s[j] > mc ? s[j] : mc;
  }
  for (int j = cn; j < kChunk; ++j) s[j] = mc;  // padding lanes (unused)
  const float a = exp_fixed(m - mc);  // exp(-inf) = 0 on the first chunk
  l = l * a;
  scale_acc<I>(acc, a, hd);
  exp_chunk<I>(s, mc, p);
  for (int j = 0; j < cn; ++j) {
    const int64_t slot = idx ? idx[c0 + j] : c0 + j;
    l = l + p[j];
    axpy<I>(acc, p[j], v + slot * vs, hd);
  }
  m = mc;
}

}  // namespace attn
}  // namespace td
#include "attn_avx2.h"    // chunk16_fast_avx2: the AVX2 register path of chunk_ref
#include "attn_avx512.h"  // chunk16_fast, scores16: the AVX-512 register path of chunk_ref
namespace td {
namespace attn {

// A full chunk of 16 keys at ranks c0..c0+15 for nq queries (slots idx[c0..] or c0.. when idx is
// null, the same for every query): the AVX-512 / AVX2 register paths when hd is 16, 32, 64 or 128,
// else chunk_ref per query. All give the same bits. `ahead`: rows the register paths prefetch.
template <int I, class T>
inline void chunk_full(int nq, const float* const* q, const T* k, int64_t ks, const T* v, int64_t vs,
                       const int32_t* idx, int c0, int hd, float scale, float* const* m, float* const* l,
                       float* const* acc, const Ahead<T>& ahead = {}) {
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    if (chunk16_fast(nq, q, k, ks, v, vs, idx, c0, hd, scale, m, l, acc, ahead)) return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {  // (bf16 scores: per query through chunk_ref's emulated dotb)
    if (!bf16_on(hd) && chunk16_fast_avx2(nq, q, k, ks, v, vs, idx, c0, hd, scale, m, l, acc, ahead)) return;
  }
#endif
  if (ahead.k) {  // no key loop to spread it over
    prefetch_rows(ahead.k, ahead.ks, kChunk, hd);
    prefetch_rows(ahead.v, ahead.vs, kChunk, hd);
  }
  for (int i = 0; i < nq; ++i) chunk_ref<I>(q[i], k, ks, v, vs, idx, c0, kChunk, hd, scale, *m[i], *l[i], acc[i]);
}

// AVX-512 attention (attn_gemm.h): widen an fp16 block's keys once per chunk before the score pass from
// kWidenMinQ queries on; defined here, outside that header's AVX-512 guard, so every build has the switch
// (set_attn_widen_keys; an AVX2-only build failed to compile on it).
inline bool g_widen_keys = true;
}  // namespace attn
}  // namespace td
#include "attn_gemm.h"  // block_gemm: the shared chunks of a block for many queries as small GEMMs
namespace td {
namespace attn {

// Whether attend_block runs a block's shared chunks through block_gemm (AVX-512) or chunk by chunk
// through chunk_full: the same bits either way; a switch for side-by-side timing (benchmarks).
inline bool g_block_gemm = true;

// Keys are reduced in blocks of kBlock ranks: block b (ranks [b kBlock, (b+1) kBlock)) starts from
// a fresh state and runs the chunks above; the blocks' states are then folded in block order (fold).
// Blocks are what lets the keys of one query be split across threads without changing its bits.
constexpr int kBlockChunks = 8;
constexpr int kBlock = kChunk * kBlockChunks;
constexpr int kMaxGroup = 64;  // queries per attend_block call
inline int num_blocks(int n) { return (n + kBlock - 1) / kBlock; }
// A block's state: acc[0..hd), m at [hd], l at [hd + 1].
inline int state_size(int hd) { return hd + 2; }


// Block b's state st[i] for each query i < nq (nq <= kMaxGroup) that has keys in it
// (n[i] > b * kBlock): query i attends to its n[i] allowed slots idx[i][0..n[i]) (or 0..n[i]-1 when
// idx[i] is null), whose first shared[i] ranks are the slots 0, 1, ... Chunks that every such query
// sees as slots 16c..16c+15 run query-inner, so those keys/values are read once for all queries.
template <int I, class T>
void attend_block(int nq, const float* const* q, const int32_t* const* idx, const int* n, const int* shared,
                  const T* k, int64_t ks, const T* v, int64_t vs, int hd, float scale, int b,
                  float* const* st) {
  const float* qa[kMaxGroup];
  float *ma[kMaxGroup], *la[kMaxGroup], *aa[kMaxGroup];
  int ia[kMaxGroup];
  const int cb = b * kBlockChunks, ce = cb + kBlockChunks;
  int na = 0, common = ce, reach = std::numeric_limits<int>::max();
  for (int i = 0; i < nq; ++i) {
    if (n[i] <= cb * kChunk) continue;
    float* s = st[i];
    for (int d = 0; d < hd; ++d) s[d] = 0.f;
    s[hd] = -std::numeric_limits<float>::infinity();
    s[hd + 1] = 0.f;
    qa[na] = q[i], aa[na] = s, ma[na] = s + hd, la[na] = s + hd + 1, ia[na] = i;
    common = std::min(common, std::min(shared[i], n[i]) / kChunk);
    reach = std::min(reach, std::min(shared[i], n[i]) / kChunk);  // chunks shared beyond this block
    ++na;
  }
  int c = cb;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    static_assert(kBlock == kGemmMaxKeys && kMaxGroup <= kGemmMaxQ, "block_gemm scratch too small");
    if (g_block_gemm && na >= kGemmMinQ && common > cb &&
        block_gemm_any(na, qa, k + (int64_t)cb * kChunk * ks, ks, v + (int64_t)cb * kChunk * vs, vs, common - cb, hd,
                       scale, ma, la, aa))
      c = common;
  }
#endif
  for (; c < common; ++c) {
    Ahead<T> ahead;  // the next shared chunk (into the next block too: often this thread's next unit)
    if constexpr (I != kScalar) {  // the register paths spread it over the chunk (attn_kv.h Ahead)
      if (c + 1 < reach)
        ahead = {k + (int64_t)(c + 1) * kChunk * ks, v + (int64_t)(c + 1) * kChunk * vs, ks, vs};
    } else if (c + 1 < common) {
      prefetch_rows(k + (int64_t)(c + 1) * kChunk * ks, ks, kChunk, hd);
      prefetch_rows(v + (int64_t)(c + 1) * kChunk * vs, vs, kChunk, hd);
    }
    chunk_full<I>(na, qa, k, ks, v, vs, nullptr, c * kChunk, hd, scale, ma, la, aa, ahead);
  }
  for (int a = 0; a < na; ++a) {
    const int i = ia[a], end = std::min(n[i], ce * kChunk);
    for (int c0 = std::max(common, cb) * kChunk; c0 < end; c0 += kChunk) {
      if (end - c0 >= kChunk)
        chunk_full<I>(1, &qa[a], k, ks, v, vs, idx[i], c0, hd, scale, &ma[a], &la[a], &aa[a]);
      else
        chunk_ref<I>(qa[a], k, ks, v, vs, idx[i], c0, end - c0, hd, scale, *ma[a], *la[a], aa[a]);
    }
  }
}

// out[d] = A[d] * a (into acc form) then fma(x[d], c, .): out = fma(x, c, out * a), elementwise
template <int I>
inline void fold_step(float* out, const float* x, float a, float c, int hd) {
  int d = 0;
#if defined(__AVX512F__)
  if constexpr (I == kAvx512) {
    const __m512 va = _mm512_set1_ps(a), vc = _mm512_set1_ps(c);
    for (; d + 16 <= hd; d += 16)
      _mm512_storeu_ps(out + d, _mm512_fmadd_ps(_mm512_loadu_ps(x + d), vc, _mm512_mul_ps(_mm512_loadu_ps(out + d), va)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (I == kAvx2) {
    const __m256 va = _mm256_set1_ps(a), vc = _mm256_set1_ps(c);
    for (; d + 8 <= hd; d += 8)
      _mm256_storeu_ps(out + d, _mm256_fmadd_ps(_mm256_loadu_ps(x + d), vc, _mm256_mul_ps(_mm256_loadu_ps(out + d), va)));
  }
#endif
  for (; d < hd; ++d) out[d] = std::fma(x[d], c, out[d] * a);
}

// out[0..hd) from nb block states st (state_size(hd) floats each, block order): folded from the empty
// state (m = -inf, l = 0, acc = 0) as  m' = max(m, m_b); a = exp(m - m'); c = exp(m_b - m');
// l = fma(l_b, c, l * a); acc[d] = fma(acc_b[d], c, acc[d] * a); then out = acc / l (zeros if nb = 0).
// One block folds to exactly its own state (a = 0, c = 1).
template <int I>
void fold(int nb, const float* st, int hd, float* out) {
  float m = -std::numeric_limits<float>::infinity(), l = 0.f;
  for (int d = 0; d < hd; ++d) out[d] = 0.f;
  for (int b = 0; b < nb; ++b) {
    const float* s = st + (int64_t)b * state_size(hd);
    const float mb = s[hd], mn = mb > m ? mb : m;
    const float a = exp_fixed(m - mn), c = exp_fixed(mb - mn);
    l = std::fma(s[hd + 1], c, l * a);
    fold_step<I>(out, s, a, c, hd);
    m = mn;
  }
  for (int d = 0; d < hd; ++d) out[d] = nb > 0 ? out[d] / l : 0.f;
}

}  // namespace attn
}  // namespace td

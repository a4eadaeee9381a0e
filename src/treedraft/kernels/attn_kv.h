// Element types of the KV cache for the decode attention (attn.h): float32, or IEEE fp16 bits (half_t),
// which halves the bytes a decode step streams. Every read widens a stored element to float32 exactly
// (to_f32 / load16 / load8), so attention over an fp16 cache gives bitwise the results of an fp32 cache
// holding the same (fp16-rounded) values on every code path. Writes round to nearest even (as torch does).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace td {
namespace attn {

using half_t = uint16_t;  // IEEE 754 binary16 bits

inline float half_to_f32_soft(half_t h) {  // exact for every half (subnormals, inf, nan)
  const uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  uint32_t bits;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= s;
  } else if (e == 31) {
    bits = s | 0x7f800000u | (m << 13);
  } else {
    bits = s | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline half_t f32_to_half_soft(float f) {  // round to nearest even; overflow -> inf
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return (half_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half (or 0); a * 2^24 is exact, nearbyint rounds to even
    float a;
    std::memcpy(&a, &x, 4);
    return (half_t)(sign | (uint32_t)std::nearbyint(a * 16777216.f));
  }
  const uint32_t r = x + 0xfffu + ((x >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round the low 13 bits
  return (half_t)(sign | (r >= 0x0f800000u ? 0x7c00u : r >> 13));
}

inline float to_f32(float x) { return x; }
inline float to_f32(half_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_f32_soft(h);
#endif
}

inline half_t f32_to_half(float f) {
#if defined(__F16C__)
  return (half_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  return f32_to_half_soft(f);
#endif
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const half_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const half_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_to_f32_soft(p[i]);
  return _mm256_load_ps(f);
#endif
}
#endif

// Prefetch rows r < n of p (stride elements apart, hd elements each), one hint per 64-byte line.
template <int Hint = _MM_HINT_T0, class T>
inline void prefetch_rows(const T* p, int64_t stride, int rows, int hd) {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(TD_NO_PREFETCH)
  constexpr int step = 64 / sizeof(T);
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < hd; d += step) {
      if constexpr (Hint == _MM_HINT_T0) _mm_prefetch((const char*)(p + r * stride + d), _MM_HINT_T0);
      else _mm_prefetch((const char*)(p + r * stride + d), _MM_HINT_T1);
    }
#endif
}

// Software prefetch of the next chunk, spread over a chunk's key loop (a block of prefetches at the
// chunk's start stalls the core on the line-fill buffers): rows j of k (stride ks) and v (stride vs);
// k null: none.
template <class T>
struct Ahead {
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t ks = 0, vs = 0;
  void row(int j, int hd) const {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(TD_NO_PREFETCH)
    if (!k) return;
    const char* pk = (const char*)(k + j * ks);
    const char* pv = (const char*)(v + j * vs);
    for (int d = 0; d < hd * (int)sizeof(T); d += 64) {
      _mm_prefetch(pk + d, _MM_HINT_T0);
      _mm_prefetch(pv + d, _MM_HINT_T0);
    }
#else
    (void)j, (void)hd;
#endif
  }
};

}  // namespace attn
}  // namespace td

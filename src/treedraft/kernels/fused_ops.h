// Per-row helpers of the fused decoder (fused.h): ISA choice, dot product, RoPE, silu*up, a row's cache
// write, and rows(): a row pass on the caller or over the thread pool. Each computes one row from that
// row alone in a fixed operation order (see fused.h), so a row's bits never depend on M or the thread.
#pragma once
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "attn.h"
#include "mm_core.h"

namespace td {

inline int default_isa() {
#if defined(__AVX512F__)
  return attn::kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return attn::kAvx2;
#else
  return attn::kScalar;
#endif
}

inline float dot_isa(int isa, const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (isa == attn::kAvx512) return attn::dot<attn::kAvx512>(a, b, n);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == attn::kAvx2) return attn::dot<attn::kAvx2>(a, b, n);
#endif
  return attn::dot<attn::kScalar>(a, b, n);
}

// fn(m) for every row m: on the pool when the rows hold enough 32-blocks of work (len floats each) to
// pay for a worker's wake-up, else on the caller. Rows are independent; fn computes a row from that
// row alone with a fixed operation order, so its bits do not depend on the thread or on M.
template <class F>
inline void rows(int64_t M, int64_t len, F&& fn) {
  if (rows_on_pool(M, len))
    pool().run([&](int m) { fn((int64_t)m); }, (int)M);
  else
    for (int64_t m = 0; m < M; ++m) fn(m);
}

// A per-thread float row of n entries (rows() may run a row on any pool thread).
inline float* row_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if ((int64_t)buf.size() < n) buf.resize(n);
  return buf.data();
}

// One row's keys/values (src: nkv k heads, then nkv v heads of hd floats) to cache slot `slot` of every
// kv head of kt / vt ((1, nkv, cap, hd) float32 or float16).
inline void write_kv(const float* src, const torch::Tensor& kt, const torch::Tensor& vt, int64_t slot, int64_t nkv,
                     int64_t hd) {
  const int64_t cap = kt.size(2);
  if (kt.scalar_type() == torch::kHalf) {  // round to nearest even, as torch's float32 -> float16 copy does
    attn::half_t* kh = (attn::half_t*)kt.data_ptr();
    attn::half_t* vh = (attn::half_t*)vt.data_ptr();
    for (int64_t g = 0; g < nkv; ++g)
      for (int64_t d = 0; d < hd; ++d) {
        kh[(g * cap + slot) * hd + d] = attn::f32_to_half(src[g * hd + d]);
        vh[(g * cap + slot) * hd + d] = attn::f32_to_half(src[(nkv + g) * hd + d]);
      }
    return;
  }
  float* kc = (float*)kt.data_ptr();
  float* vc = (float*)vt.data_ptr();
  for (int64_t g = 0; g < nkv; ++g) {
    std::memcpy(kc + (g * cap + slot) * hd, src + g * hd, hd * sizeof(float));
    std::memcpy(vc + (g * cap + slot) * hd, src + (nkv + g) * hd, hd * sizeof(float));
  }
}

// HF rotate-half RoPE of one head (v: 2 * half floats) with that row's cos c and sin s (half each).
inline void rope(float* v, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * c[i] - b * s[i];
    v[i + half] = b * c[i] + a * s[i];
  }
}

// out = silu(g) * u over n floats (attn::exp_fixed: the same bits on every ISA path).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n, int isa) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if (isa == attn::kAvx512) {
    const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 e = attn::exp_fixed16(_mm512_sub_ps(zero, gv));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == attn::kAvx2) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = attn::exp_fixed8(_mm256_sub_ps(zero, gv));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + attn::exp_fixed(0.f - g[i])) * u[i];
}

// out = gelu_tanh(g) * u over n floats (transformers' "gelu_pytorch_tanh", Gemma's gate), written as
// 0.5 g (1 + tanh(z)) = g / (1 + exp(-2z)), z = sqrt(2/pi) (g + 0.044715 g^3): silu_mul's form on 2z
// (attn::exp_fixed; the inner polynomial through fma on every path, so every ISA path gives the same bits).
inline void gelu_tanh_mul(const float* g, const float* u, float* out, int64_t n, int isa) {
  const float m2c = -1.5957691216057308f, k = 0.044715f;  // -2 sqrt(2 / pi)
  int64_t i = 0;
#if defined(__AVX512F__)
  if (isa == attn::kAvx512) {
    const __m512 one = _mm512_set1_ps(1.f), vm = _mm512_set1_ps(m2c), vk = _mm512_set1_ps(k);
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = _mm512_loadu_ps(g + i);
      const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(vk, _mm512_mul_ps(gv, gv)), gv, gv);
      const __m512 e = attn::exp_fixed16(_mm512_mul_ps(vm, inner));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa == attn::kAvx2) {
    const __m256 one = _mm256_set1_ps(1.f), vm = _mm256_set1_ps(m2c), vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(vk, _mm256_mul_ps(gv, gv)), gv, gv);
      const __m256 e = attn::exp_fixed8(_mm256_mul_ps(vm, inner));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float inner = std::fma(k * (g[i] * g[i]), g[i], g[i]);
    out[i] = g[i] / (1.f + attn::exp_fixed(m2c * inner)) * u[i];
  }
}

}  // namespace td

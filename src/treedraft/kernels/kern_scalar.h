// Portable scalar kernels: the reference the SIMD paths must equal bitwise.
#pragma once
#include <cmath>

#include "common.h"

namespace td {

inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h >> 15) << 31;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void tile_q4_1_scalar(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                             int ncols) {
  for (int r = r0; r < r0 + rb; ++r) {
    for (int c = 0; c < ncols; ++c) {
      float acc = 0.f;
      const uint8_t* wb = w;
      for (int b = 0; b < a.B; ++b, wb += kQ41Bytes) {
        const int8_t* x = a.q + ((int64_t)b * a.M + r) * kQK;
        int32_t isum = 0;
        for (int i = 0; i < 4; ++i) {
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = wb[64 * i + 4 * c + j];
            isum += (int32_t)(byte & 0xF) * x[4 * i + j];
            isum += (int32_t)(byte >> 4) * x[16 + 4 * i + j];
          }
        }
        uint16_t dh, mh;
        std::memcpy(&dh, wb + 256 + 2 * c, 2);
        std::memcpy(&mh, wb + 288 + 2 * c, 2);
        const float sc = fp16_to_f32(dh) * a.d[(int64_t)b * a.M + r];
        acc = std::fma((float)isum, sc, acc);
        acc = std::fma(fp16_to_f32(mh), a.s[(int64_t)b * a.M + r], acc);
      }
      out[(int64_t)r * ldo + c] = acc;
    }
  }
}

inline void tile_q8_0_scalar(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                             int ncols) {
  for (int r = r0; r < r0 + rb; ++r) {
    for (int c = 0; c < ncols; ++c) {
      float acc = 0.f;
      const uint8_t* wb = w;
      for (int b = 0; b < a.B; ++b, wb += kQ80Bytes) {
        const int8_t* x = a.q + ((int64_t)b * a.M + r) * kQK;
        int32_t isum = 0;
        for (int i = 0; i < 8; ++i)
          for (int j = 0; j < 4; ++j)
            isum += (int32_t)(int8_t)wb[64 * i + 4 * c + j] * x[4 * i + j];
        uint16_t dh;
        std::memcpy(&dh, wb + 512 + 2 * c, 2);
        const float sc = fp16_to_f32(dh) * a.d[(int64_t)b * a.M + r];
        acc = std::fma((float)isum, sc, acc);
      }
      out[(int64_t)r * ldo + c] = acc;
    }
  }
}

}  // namespace td

// Shared definitions of the quantized GEMM: packed layout and quantized activations.
//
// Packed weights (built by treedraft.kernels.pack_*; see __init__.py): output columns are grouped
// in tiles of 16 (the last tile zero-padded); a tile stores its K/32 blocks one after another.
//
//   Q4_1 block (320 bytes): nib[4][64] | d[16] fp16 | m[16] fp16
//     byte 4c+j of nib[i] = q[c][4i+j] | q[c][16+4i+j] << 4      (c: column in tile, j: 0..3)
//     so the low nibbles of nib[i] hold k = 4i..4i+3, the high nibbles k = 16+4i..16+4i+3,
//     and one 64-byte vector holds 4 consecutive k for all 16 columns.
//   Q8_0 block (544 bytes): qs[8][64] int8 | d[16] fp16
//     byte 4c+j of qs[i] = q[c][4i+j]   (one 64-byte vector: 4 consecutive k of all 16 columns, as
//     for Q4_1, so both kinds feed vpmaddubsw with one broadcast 4-byte activation group)
//
// Activations are quantized per row and 32-block to int8 (llama.cpp's Q8_1 idea):
// x ~= d * q, q in [-127, 127], s = d * sum(q) (needed for Q4_1's min term).
//
// Per output (row r, column n) and block b every code path computes, in this order,
//   acc = fma((float)isum, dw * dx, acc)          isum = exact int dot product of the block
//   acc = fma(mw, s, acc)                          (Q4_1 only)
// so results are bitwise identical across ISA paths, row positions and row counts.
#pragma once
#include <cstdint>
#include <cstring>

namespace td {

constexpr int kTile = 16;       // output columns per tile
constexpr int kQK = 32;         // weights per quantization block
constexpr int kQ41Bytes = 320;  // bytes per (tile, block) for Q4_1
constexpr int kQ80Bytes = 544;  // bytes per (tile, block) for Q8_0

// Block-major storage: block b of row m is at q + (b * M + m) * 32, its scale at d[b * M + m], so
// the rows of one block sit next to each other and a kernel addresses them by constant offsets.
struct Act {
  int M = 0;                     // rows
  int K = 0;                     // row length
  int B = 0;                     // blocks per row (K / 32)
  const int8_t* q = nullptr;  // (B, M, 32) quantized values
  const float* d = nullptr;   // (B, M) scales
  const float* s = nullptr;   // (B, M) d * sum(q)
  const int32_t* n = nullptr;  // (B, M) -128 * sum(q): the bias term of Q8_0's VNNI kernel (kern_avx512.h dot_q8_biased)
};

// Runtime tunables of the matmul, neither changes any result bit (set by qgemm.set_tuning):
// software prefetch distance in bytes ahead of the weight block being read (0 = none; ~4 KB keeps
// the next 4 KB page on its way when the hardware streamer stops at the page boundary), and the
// smallest work unit of a call in weight bytes (a claim costs an atomic; see mm_into).
inline int g_prefetch_ahead = 4096;
inline int64_t g_unit_bytes = 16 << 10;

// One (tile, row-chunk) call: rows r0..r0+rb of the activations against one weight tile.
// Writes out[(r0 + r) * ldo + c] for c < ncols.
using TileFn = void (*)(const uint8_t* w, const Act& a, int r0, int rb, float* out, int ldo,
                        int ncols);

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace td

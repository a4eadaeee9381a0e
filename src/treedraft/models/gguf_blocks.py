"""A GGUF tensor's quantized blocks, unpacked into plain tensors without dequantizing.

Layouts follow ggml (``ggml-quants.c`` / the ``gguf`` package's ``quants.py``); every unpacker here is
checked bit-exactly against ``gguf.quants.dequantize`` (tests/test_quant.py); the file's
header and tensor table come from :mod:`.gguf_meta`:

- Q4_1 (32 weights, 20 bytes): d fp16, m fp16, qs[16]; low nibble of qs[j] = element j, high = j + 16;
  ``w = d * q + m``.
- Q4_0 (18 bytes): d fp16, qs[16] as Q4_1; ``w = d * (q - 8)``, written here as Q4_1 with ``m = -8 d``
  (``d*q`` and ``8d`` are exact in float32, so ``d*q + (-8d)`` rounds to the same value).
- Q4_K (256 weights, 144 bytes): d, dmin fp16, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32,
  qs[128] (each 64-weight chunk: low nibbles = first 32, high nibbles = next 32);
  ``w = (d * sc) * q - dmin * mn``: Q4_1 with group 32, ``scale = d*sc``, ``minv = -(dmin*mn)``.
- Q8_0 (32 weights, 34 bytes): d fp16, qs int8[32]; ``w = d * q``.
- Q5_0 (32 weights, 22 bytes): d fp16, qh (4 bytes, little-endian: bit j = element j's fifth bit), qs[16] as
  Q4_1; ``w = d * (q - 16)``, q - 16 in -16..15: exactly Q8_0's form (Gemma 3's GGUFs use it for most linears).

The packed kernels keep every group's scale (and min) in fp16, as the file does for Q4_0 / Q4_1 / Q5_0 / Q8_0;
Q4_K's ``d*sc`` and ``dmin*mn`` are exact in float32 but not always in fp16, so its packed weights round them
(relative 2^-11, far below the 4-bit step; quant_load rounds them before packing).

Q6_K (and every other type) has no exact mapping onto the int4/int8 kernels: callers dequantize it and
re-quantize with a warning naming the tensor (see :mod:`treedraft.models.quant`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# ggml type ids (gguf.GGMLQuantizationType) of the formats unpacked here
F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 0, 1, 2, 3, 6, 8, 12, 14
# types that map exactly onto the (scale, minv, 4-bit q) group-32 form
Q4_FAMILY = (Q4_0, Q4_1, Q4_K)
_BLOCK = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q8_0: (32, 34),
    Q4_K: (256, 144),
}  # (weights, bytes) per block


def _blocks(raw: np.ndarray, shape: tuple[int, int], qtype: int) -> np.ndarray:
    """raw (N, bytes per row) uint8 -> (N, K / block, bytes per block), checking the sizes."""
    n, k = shape
    per, size = _BLOCK[qtype]
    if k % per:
        raise ValueError(f"row length {k} is not a multiple of the block size {per} of ggml type {qtype}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size != n * (k // per) * size:
        raise ValueError(
            f"{raw.size} bytes of ggml type {qtype} do not hold a {n}x{k} tensor ({n * (k // per) * size} expected)"
        )
    return raw.reshape(n, k // per, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 little-endian fp16 -> (...) float32 (exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(..., 16) packed bytes -> (..., 32) uint8: element j = low nibble of byte j, j + 16 = high nibble."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def unpack_q4_1(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_1 blocks -> (scale (N, K/32) f32, minv (N, K/32) f32, q (N, K) uint8 in 0..15); w = scale*q + minv."""
    b = _blocks(raw, shape, Q4_1)  # (N, K/32, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    q = _nibbles32(b[..., 4:20]).reshape(shape)
    return torch.from_numpy(d), torch.from_numpy(m), torch.from_numpy(q)


def unpack_q4_0(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_0 blocks in Q4_1 form: (scale, minv = -8 * scale, q in 0..15); exact (see module doc)."""
    b = _blocks(raw, shape, Q4_0)  # (N, K/32, 18)
    d = _f16(b[..., 0:2])
    q = _nibbles32(b[..., 2:18]).reshape(shape)
    return torch.from_numpy(d), torch.from_numpy(d * np.float32(-8.0)), torch.from_numpy(q)


def _q4k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., 12) packed 6-bit scales and mins -> (sc (..., 8), mn (..., 8)) as float32."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K super-blocks in group-32 Q4_1 form: (scale = d*sc, minv = -(dmin*mn), q in 0..15); exact."""
    n, k = shape
    b = _blocks(raw, shape, Q4_K)  # (N, K/256, 144)
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]  # (N, K/256, 1)
    sc, mn = _q4k_scale_min(b[..., 4:16])  # (N, K/256, 8)
    qs = b[..., 16:144].reshape(n, k // 256, 4, 32)  # 4 chunks of 64 weights
    q = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(shape)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    scale = (d * sc).reshape(n, k // 32)
    minv = -(dmin * mn).reshape(n, k // 32)
    return torch.from_numpy(scale), torch.from_numpy(minv), torch.from_numpy(np.ascontiguousarray(q))


def unpack_q8_0(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Q8_0 blocks -> (scale (N, K/32) f32, q (N, K) int8); w = scale * q."""
    b = _blocks(raw, shape, Q8_0)  # (N, K/32, 34)
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).reshape(shape)
    return torch.from_numpy(d), torch.from_numpy(q)


def unpack_q5_0(raw: np.ndarray, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Q5_0 blocks in Q8_0 form: (scale (N, K/32) f32, q (N, K) int8 in -16..15); w = scale * q, exact."""
    b = _blocks(raw, shape, Q5_0)  # (N, K/32, 22)
    d = _f16(b[..., 0:2])
    qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # (N, K/32, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # (N, K/32, 32): element j's bit 4
    q = (_nibbles32(b[..., 6:22]) | high).astype(np.int8) - np.int8(16)
    return torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(q).reshape(shape))


UNPACK_Q4 = {Q4_0: unpack_q4_0, Q4_1: unpack_q4_1, Q4_K: unpack_q4_k}


def dequantize_q4(scale: Tensor, minv: Tensor, q: Tensor, group: int = 32) -> Tensor:
    """(scale, minv, q) -> float32 weights (N, K): w = scale * q + minv, per group of ``group`` columns."""
    n, k = q.shape
    qf = q.float().view(n, k // group, group)
    return (scale[..., None] * qf + minv[..., None]).view(n, k)


def dequantize_q8(scale: Tensor, q: Tensor, group: int = 32) -> Tensor:
    """(scale, q) -> float32 weights (N, K): w = scale * q per group of ``group`` columns."""
    n, k = q.shape
    return (q.float().view(n, k // group, group) * scale[..., None]).view(n, k)

"""Native quantized (Q4_1 / Q8_0) CPU matmul for weight-only-quantized linears.

``mm(x, pack_q4_1(...))`` computes ``x @ W.T`` with W kept in llama.cpp's block formats; the
activations are quantized per row and 32-block to int8 inside the kernel (as llama.cpp does), so
each output row depends only on its own input row: rows are bitwise identical whatever the number
of rows or their order (what exact speculative decoding needs).

``attend(q, k, v, allowed, scale)`` is a decode attention with the same property for tree rows:
each row reduces over its allowed keys in an order that depends only on their rank, so a tree node
gets the bits of the plain one-token step at its position (see attn.h).

The C++ source is compiled at first use with ``torch.utils.cpp_extension`` into
``cache_dir()/kernels/<key>`` (key = CPU model and flags, compiler flags, torch version, source
hash); later processes load the built module directly. ``TREEDRAFT_NO_EXT=1`` disables it; when
it is disabled or the build fails, ``available()`` is False, ``unavailable_reason()`` says why and
``mm`` falls back to a dequantized float32 matmul.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np
import torch

from treedraft.kernels._build import MAX_IDLE_US, build_info, load_extension, loaded_extension

__all__ = [
    "PackedWeight",
    "available",
    "unavailable_reason",
    "pack_q4_1",
    "pack_q8_0",
    "mm",
    "set_num_threads",
    "get_num_threads",
    "paths",
    "build_info",
    "attend",
    "read_bandwidth",
    "torch_threads",
    "set_tuning",
    "set_idle_wait",
    "q4_pair_supported",
    "set_q4_pair",
    "sample_probs",
    "sample_draw",
    "gumbel_topk",
]

TILE = 16  # output columns per packed tile
QK = 32  # weights per quantization block
Q4_1, Q8_0 = 0, 1
_BLOCK_BYTES = {Q4_1: 320, Q8_0: 544}
_KIND_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}


def _ext() -> ModuleType | None:
    """The loaded extension, or None (reason in unavailable_reason())."""
    return load_extension()


def available() -> bool:
    """True when the native kernel is built and loaded on this machine."""
    return _ext() is not None


def unavailable_reason() -> str | None:
    """Why the native kernel is not available (None when it is)."""
    return None if available() else build_info().get("reason")


def paths() -> list[str]:
    """Compiled code paths, fastest first (e.g. ['avx512vnni', 'avx512', 'avx2', 'scalar'])."""
    ext = _ext()
    return list(ext.paths()) if ext is not None else []


def set_num_threads(n: int) -> None:
    """Threads used by mm (the calling thread included)."""
    ext = _ext()
    if ext is not None:
        ext.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads used by mm (1 when the extension is unavailable)."""
    ext = _ext()
    return int(ext.get_num_threads()) if ext is not None else 1


def set_idle_wait(spin_us: int | None = None, yield_us: int | None = None) -> None:
    """How an idle pool worker waits for the next call: ``spin_us`` of pause-loop spinning (default 100), then
    ``yield_us`` of polling with sched_yield (default 2000; ``TREEDRAFT_POOL_YIELD_US`` at load), then sleep. None
    keeps a setting. Never changes a result bit, only when a worker is awake (the pool is rebuilt at the next call).

    The yielding phase covers the Python work between two decode forwards (drafting, acceptance: 0.1-1.5 ms):
    a worker asleep then woke ~0.45 ms late on session 43's KVM Xeon; sched_yield gives the core to any other
    runnable thread at once, so a busy machine loses nothing to it.
    """
    for name, v in (("spin_us", spin_us), ("yield_us", yield_us)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_IDLE_US):
            raise ValueError(f"{name} must be a whole number of microseconds from 0 to {MAX_IDLE_US}, got {v!r}")
    ext = _ext()
    if ext is None:
        return
    if spin_us is not None:
        ext.set_spin_us(spin_us)
    if yield_us is not None:
        ext.set_yield_us(yield_us)


def idle_workers_asleep() -> int:
    """How many of the pool's workers are asleep now (-1: no pool yet or no extension); for tests of the idle wait."""
    ext = _ext()
    return -1 if ext is None else int(ext.pool_asleep())


def set_tuning(prefetch_bytes: int | None = None, unit_bytes: int | None = None) -> tuple[int, int]:
    """Set the matmul's software prefetch distance and smallest work unit (bytes; None keeps); returns both.

    Neither changes any result bit (only speed): for measuring them on a machine (benchmarks/fused_ab.py
    --tunings). Defaults 4096 and 16384.
    """
    ext = _ext()
    if ext is None or not hasattr(ext, "set_tuning"):
        raise RuntimeError(f"set_tuning needs the native kernel ({unavailable_reason()})")
    for name, v in (("prefetch_bytes", prefetch_bytes), ("unit_bytes", unit_bytes)):
        if v is not None and v < 0:
            raise ValueError(f"set_tuning: {name} must be >= 0, got {v}")
    pf, ub = ext.set_tuning(
        -1 if prefetch_bytes is None else int(prefetch_bytes), -1 if unit_bytes is None else int(unit_bytes)
    )
    return int(pf), int(ub)


def q4_pair_supported() -> bool:
    """Whether the default code path has the 32-column Q4_1 kernel (AVX-512 VNNI builds; kernels/kern_avx512.h)."""
    ext = _ext()
    return ext is not None and hasattr(ext, "q4_pair_supported") and bool(ext.q4_pair_supported())


def set_q4_pair(on: bool) -> None:
    """Run full Q4_1 tiles in pairs through the 32-column kernel (True, the default where supported) or one by one.

    No result bit changes (only speed); chosen per machine by measurement (models/quant.py choose_q4_pair).
    """
    if not q4_pair_supported():
        raise RuntimeError("set_q4_pair: this build has no 32-column Q4_1 kernel (AVX-512 VNNI only)")
    _ext().set_q4_pair(bool(on))


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch's intra-op threads set to n (None: unchanged), restored afterwards.

    Decode steps of the native runtime use it with n = 1: the native pool (:func:`set_num_threads`) does
    the forward, and the small torch ops around it (sampling, KV compaction, drafting) are faster on one
    thread than on an OpenMP team whose idle threads spin (libgomp: ~300k pause loops, milliseconds)
    on the core the native pool, or another process, needs: on the 2-core Xeon with other jobs running,
    the time outside the native call per generation fell 5x (benchmarks/busy_threads.py).
    """
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@dataclass(eq=False)
class PackedWeight:
    """A (N, K) weight repacked for the kernel: tiles of 16 output columns, fp16 block scales."""

    data: torch.Tensor  # uint8 (ceil(N/16) * K/32 * block_bytes,)
    N: int
    K: int
    kind: int  # Q4_1 or Q8_0
    _dequantized: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel streams per call (padding included)."""
        return self.data.numel()

    @property
    def kind_name(self) -> str:
        """'Q4_1' or 'Q8_0'."""
        return _KIND_NAMES[self.kind]

    def first_rows(self, n: int) -> PackedWeight:
        """The first ``n`` output rows as a packed weight of their own: a view of the leading tiles, no copy
        (``n`` a multiple of the 16-row tile below N, or N itself)."""
        if n == self.N:
            return self
        if n % TILE or not 0 < n < self.N:
            raise ValueError(f"first_rows: n must be a positive multiple of {TILE} up to N={self.N}, got {n}")
        return PackedWeight(self.data[: n // TILE * (self.K // QK) * _BLOCK_BYTES[self.kind]], n, self.K, self.kind)

    def dequantize(self) -> torch.Tensor:
        """The float32 (N, K) weight this packs (exact: the same fp16 scales the kernel uses)."""
        T, B = -(-self.N // TILE), self.K // QK
        blocks = self.data.view(T, B, _BLOCK_BYTES[self.kind])
        if self.kind == Q4_1:
            nib = blocks[:, :, :256].reshape(T, B, 4, TILE, 4)  # (T, B, i, c, j)
            lo, hi = nib & 0xF, nib >> 4
            q = torch.stack([lo, hi], dim=2)  # (T, B, h, i, c, j)
            q = q.permute(0, 4, 1, 2, 3, 5).reshape(T * TILE, self.K)  # k = 16h + 4i + j
            d = blocks[:, :, 256:288].contiguous().view(torch.float16)  # (T, B, 16)
            m = blocks[:, :, 288:320].contiguous().view(torch.float16)
            d = d.permute(0, 2, 1).reshape(T * TILE, B).float()
            m = m.permute(0, 2, 1).reshape(T * TILE, B).float()
            w = q.float().view(-1, B, QK) * d[..., None] + m[..., None]
        else:
            qs = blocks[:, :, :512].contiguous().view(torch.int8).reshape(T, B, 8, TILE, 4)
            q = qs.permute(0, 3, 1, 2, 4).reshape(T * TILE, self.K)  # k = 4i + j
            d = blocks[:, :, 512:544].contiguous().view(torch.float16)
            d = d.permute(0, 2, 1).reshape(T * TILE, B).float()
            w = q.float().view(-1, B, QK) * d[..., None]
        return w.reshape(T * TILE, self.K)[: self.N].contiguous()


def _check(name: str, t: torch.Tensor, shape: tuple[int, int], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {dtypes}")


def _fp16_scales(name: str, t: torch.Tensor, T: int) -> torch.Tensor:
    """(N, B) f32 -> (T, B, 16) fp16 as uint8 bytes (T, B, 32); warns if fp16 changes values."""
    N, B = t.shape
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t.float()):
        err = (h.float() - t.float()).abs().max().item()
        warnings.warn(
            f"pack: {name} is stored as fp16 (as in GGUF); rounding changed it by up to "
            f"{err:.3g}. Round it to fp16 before packing to keep exact weights.",
            stacklevel=3,
        )
    h = torch.nn.functional.pad(h, (0, 0, 0, T * TILE - N))
    return h.view(T, TILE, B).permute(0, 2, 1).contiguous().view(torch.uint8).view(T, B, 2 * TILE)


def pack_q4_1(scale: torch.Tensor, minv: torch.Tensor, q: torch.Tensor) -> PackedWeight:
    """Pack Q4_1 weights w = scale * q + minv (groups of 32 along K; q in 0..15)."""
    N, K = q.shape
    if K % QK:
        raise ValueError(f"pack_q4_1: K={K} must be a multiple of {QK}")
    B, T = K // QK, -(-N // TILE)
    _check("q", q, (N, K), (torch.uint8,))
    _check("scale", scale, (N, B), (torch.float32, torch.float16))
    _check("minv", minv, (N, B), (torch.float32, torch.float16))
    if int(q.max()) > 15:
        raise ValueError("pack_q4_1: q must hold 4-bit values 0..15")
    qp = torch.nn.functional.pad(q, (0, 0, 0, T * TILE - N)).view(T, TILE, B, 2, 4, 4)  # c, b, h, i, j
    qp = qp.permute(0, 2, 3, 4, 1, 5)  # (T, B, h, i, c, j)
    nib = (qp[:, :, 0] | (qp[:, :, 1] << 4)).reshape(T, B, 256)
    blocks = torch.cat([nib, _fp16_scales("scale", scale, T), _fp16_scales("minv", minv, T)], dim=2)
    return PackedWeight(blocks.reshape(-1).contiguous(), N, K, Q4_1)


def pack_q8_0(scale: torch.Tensor, q: torch.Tensor) -> PackedWeight:
    """Pack Q8_0 weights w = scale * q (groups of 32 along K; q int8)."""
    N, K = q.shape
    if K % QK:
        raise ValueError(f"pack_q8_0: K={K} must be a multiple of {QK}")
    B, T = K // QK, -(-N // TILE)
    _check("q", q, (N, K), (torch.int8,))
    _check("scale", scale, (N, B), (torch.float32, torch.float16))
    qp = torch.nn.functional.pad(q, (0, 0, 0, T * TILE - N)).view(T, TILE, B, 8, 4)  # c, b, i, j
    qs = qp.permute(0, 2, 3, 1, 4).reshape(T, B, 512).view(torch.uint8)  # byte 4c + j of qs[i]: k = 4i + j
    blocks = torch.cat([qs, _fp16_scales("scale", scale, T)], dim=2)
    return PackedWeight(blocks.reshape(-1).contiguous(), N, K, Q8_0)


_warned_fallback = False


def read_bandwidth(mbytes: int = 256, reps: int = 5) -> float:
    """GB/s the kernel's thread pool reads from memory (best of reps over an mbytes buffer, > L3)."""
    ext = _ext()
    if ext is None:
        raise RuntimeError(f"read_bandwidth needs the native kernel ({unavailable_reason()})")
    if mbytes < 1 or reps < 1:
        raise ValueError(f"read_bandwidth: need mbytes >= 1 and reps >= 1, got {mbytes}, {reps}")
    buf = torch.ones(mbytes << 20, dtype=torch.uint8)
    return float(ext.read_bandwidth(buf, reps))


def _on_cpu(name: str, *ts: torch.Tensor) -> None:
    """The native kernels read host memory: a tensor elsewhere (a GPU's) would be read through its device pointer."""
    for t in ts:
        if t.device.type != "cpu":
            raise ValueError(f"{name}: the native kernels are CPU code, got a tensor on {t.device}")


def mm(x: torch.Tensor, w: PackedWeight, *, path: str = "") -> torch.Tensor:
    """y (M, N) = x (M, K) float32 @ W^T for a packed weight (path: force 'avx2'/'scalar'/...)."""
    _on_cpu("mm", x)
    if x.dim() != 2 or x.shape[1] != w.K:
        raise ValueError(f"mm: x must be (M, {w.K}), got {tuple(x.shape)}")
    ext = _ext()
    if ext is None:
        global _warned_fallback
        if not _warned_fallback:
            warnings.warn(
                f"treedraft.kernels: native kernel unavailable ({unavailable_reason()}); "
                "using a dequantized float32 matmul",
                stacklevel=2,
            )
            _warned_fallback = True
        if w._dequantized is None:
            w._dequantized = w.dequantize()
        return x.float() @ w._dequantized.T
    return ext.mm(x.float().contiguous(), w.data, w.N, w.kind, path)


def mm_f32(x: torch.Tensor, w: torch.Tensor, *, path: str = "") -> torch.Tensor:
    """y (M, N) = x (M, K) @ w (N, K)^T in float32 with every row computed the same way whatever M (kernels/
    f32mm.h: a tree row equals the 1-token row bitwise, which BLAS does not promise); path: force 'avx2' /
    'scalar' (same bits). Needs the native kernel (:func:`available`)."""
    _on_cpu("mm_f32", x, w)
    ext = _ext()
    if ext is None:
        raise RuntimeError(f"mm_f32 needs the native kernel ({unavailable_reason()})")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"mm_f32: need x (M, K) and w (N, K), got {tuple(x.shape)} and {tuple(w.shape)}")
    return ext.mm_f32(x.float().contiguous(), w.float().contiguous(), path)


def topk_rows(
    x: torch.Tensor, k: int, log_softmax: bool = False, *, load: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x (R, V) float32: its k largest entries, best first (equal values: the lower column first), as
    (values (R, k) float64, columns (R, k) int64); with ``log_softmax`` the values are the entries' float64
    log-softmax (logit - logsumexp of the row). Natively one pass over each row (kernels/topk.h: 3 us for a
    4096-column row where the NumPy calls cost ~40 us right after a forward); in NumPy without the kernel. The two
    agree on the columns, and to float32 resolution on log-softmax values (the native exp is float32). ``load``
    False: the native kernel only if this process already loaded it (NumPy otherwise; never a build)."""
    if x.dim() != 2 or not 1 <= k <= x.shape[1]:
        raise ValueError(f"topk_rows: need x (R, V) and 1 <= k <= V, got {tuple(x.shape)} and k={k}")
    x = x.detach().cpu()
    ext = _ext() if load else loaded_extension()  # load=False: never build or load it here
    if ext is not None and hasattr(ext, "topk_rows"):
        vals, ids = ext.topk_rows(x.float().contiguous(), int(k), bool(log_softmax))
        return vals.numpy(), ids.numpy()
    lg = x.float().numpy()
    top = np.argsort(-lg, axis=-1, kind="stable")[:, :k]  # best first, then the lower column (NaN last)
    raw = np.take_along_axis(lg, top, -1).astype(np.float64)
    if not log_softmax:
        return raw, top.astype(np.int64)
    lg64 = lg.astype(np.float64)  # logsumexp in float64 (a per-row shift: the order stays)
    m = lg64.max(-1, keepdims=True)
    return raw - (m + np.log(np.exp(lg64 - m).sum(-1, keepdims=True))), top.astype(np.int64)


def sample_probs(
    x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor | None:
    """Each row of x (R, V) float32 on the CPU -> its sampling distribution after temperature, top-k, min-p and
    top-p (kernels/sample.h; treedraft.sampling.target_probs defines it); None when the native kernel is not
    loaded in this process (this never builds it) or a row has no finite maximum."""
    ext = loaded_extension()
    if ext is None or not hasattr(ext, "sample_probs"):
        return None
    x = x.detach().float().contiguous()
    return ext.sample_probs(x, float(temperature), int(top_k), float(top_p), float(min_p))


def sample_draw(
    row: torch.Tensor, temperature: float, top_k: int, top_p: float, u: float, min_p: float = 0.0
) -> int | None:
    """The token of a (V,) float32 CPU logits row whose CDF (id order, float64) first passes u * total, under
    temperature, top-k, min-p and top-p: one inverse-transform draw in one native call; None as for sample_probs."""
    ext = loaded_extension()
    if ext is None or not hasattr(ext, "sample_draw"):
        return None
    row = row.detach().to("cpu", torch.float32).contiguous()
    x = ext.sample_draw(row, float(temperature), int(top_k), float(top_p), float(u), float(min_p))
    return None if x < 0 else int(x)


def gumbel_topk(
    row: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    key: int,
    k: int,
    cols: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The k tokens of a (V,) float32 CPU logits row's support (under temperature, top-k, min-p, top-p) with the
    largest (z - max z) + Gumbel noise keyed by (``key``, token id), best first, as (columns int64, scores float64)
    (kernels/sample.h gumbel_topk_row; ``cols``: the token id of each column). None when the native kernel is not
    loaded in this process or the row has no finite maximum (callers then use treedraft.sampling's version)."""
    ext = loaded_extension()
    if ext is None or not hasattr(ext, "gumbel_topk"):
        return None
    row = row.detach().to("cpu", torch.float32).contiguous()
    return ext.gumbel_topk(row, float(temperature), int(top_k), float(top_p), float(min_p), int(key), int(k), cols)


def set_row_pass_blocks(blocks: int | None) -> int | None:
    """Run row passes of at least ``blocks`` 32-blocks over the thread pool (None: all on the calling thread).

    Row passes are the fused decoder's per-row work (norms, RoPE, cache writes, silu, activation
    quantization); no result bit depends on this. Returns the previous setting (None for "caller only").
    """
    if blocks is not None and blocks < 0:
        raise ValueError(f"set_row_pass_blocks: blocks must be >= 0 or None, got {blocks}")
    ext = _ext()
    if ext is None:
        return None
    old = ext.set_row_pass_blocks(_ROW_PASS_CALLER if blocks is None else int(blocks))
    return None if old >= _ROW_PASS_CALLER else old


_ROW_PASS_CALLER = 1 << 40  # mm_core.h kRowPassCaller


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native GEMM's int8 activation codes of x (M, K): q (M, K) int8, d (M, K/32), s = d * sum(q) (M, K/32)."""
    _on_cpu("quantize_activations", x)
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"quantize_activations: x must be (M, K) with K a multiple of 32, got {tuple(x.shape)}")
    ext = _ext()
    if ext is None:
        raise RuntimeError(f"quantize_activations: native kernel unavailable ({unavailable_reason()})")
    q, d, s = ext.quantize(x.float().contiguous())  # (B, M, 32), (B, M), (B, M)
    M = x.shape[0]
    return q.permute(1, 0, 2).reshape(M, -1), d.T.contiguous(), s.T.contiguous()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    *,
    path: str = "",
    bf16_scores: bool = False,
) -> torch.Tensor:
    """Row-invariant attention: q (T, nh, hd), k/v (nkv, L, hd), allowed bool (T, L) or None -> (T, nh, hd).

    q is float32; k and v float32 or float16 (a half-size KV cache: each element is widened exactly, so
    the result equals the float32 call on ``k.float()``, ``v.float()`` bitwise).

    Each row attends to its allowed keys in increasing slot order with a reduction order that depends
    only on a key's rank in that list, so a row's result equals the one-row call over the same keys
    stored contiguously (bitwise). GQA: head h uses kv head h // (nh // nkv). Needs the extension
    (check ``available()``); path forces 'avx512'/'avx2'/'scalar' (all give the same bits).

    bf16_scores: each score q.k from q and k rounded to bfloat16, summed as vdpbf16ps does (the scalar and AVX2 paths
    emulate it bit for bit), where hd % 32 == 0 (else float32 scores); the AVX-512 path needs
    :func:`bf16_scores_supported`. Still the same bits for a row whatever the other rows; not the float32 scores.
    """
    _on_cpu("attend", q, k, v)
    ext = _ext()
    if ext is None:
        raise RuntimeError(f"treedraft.kernels.attend needs the native extension ({unavailable_reason()})")
    if q.dtype != torch.float32 or k.dtype != v.dtype or k.dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"attend: q must be float32 and k, v both float32 or both float16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    empty = torch.empty(0, dtype=torch.bool)
    allowed = empty if allowed is None else allowed.to(torch.bool)
    return ext.attend(q, k, v, allowed, float(scale), path, bool(bf16_scores))


def bf16_scores_supported() -> bool:
    """Whether the native attention's default (AVX-512) path has bf16 scores: a build with AVX512-BF16."""
    ext = _ext()
    return bool(ext is not None and getattr(ext, "bf16_scores_supported", lambda: False)())

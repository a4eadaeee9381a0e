"""Weight-only quantized linears that swap in for :class:`~treedraft.models.llama.Linear` (gpt-fast habit:
swap modules, never edit the model).

Formats (what a weight is stored as) and kernels (what multiplies by it):

- ``q4``: group-32 ``w = scale * q + minv``, q in 0..15: the GGUF's own Q4_1 / Q4_0 / Q4_K blocks
  (:mod:`.gguf_blocks`), or round-to-nearest from float weights. Kernels: ``int4pack`` (PyTorch's
  ``_weight_int4pack_mm_for_cpu``; w = (q - 8) * scale + zero, so zero = minv + 8 * scale) and ``native``.
- ``q8``: group-32 ``w = scale * q``, q int8: the GGUF's Q8_0 blocks, or round-to-nearest. Kernels:
  ``int8pack`` (``_weight_int8pack_mm``, one scale per output row: a q8 weight is re-quantized per row,
  which is not exact) and ``native``.

The stock kernels are vectorized on x86 only for bf16 activations, so they take bf16 inputs and bf16
group scales: the 4-bit values q are the file's own, the scales/zeros are rounded to bf16 (8 significant
bits) and each output is rounded to bf16 before it returns as float32. ``scale_dtype=torch.float32`` keeps
the scales exact (the file's weights bit for bit) but runs the slow scalar path: tests only.

``native`` is the optional package ``treedraft.kernels`` (``available()``, ``pack_q4_1(scale, minv, q)``,
``pack_q8_0(scale, q)``, ``mm(x (M, K) f32, packed) -> (M, N) f32``). Which kernel serves a format is
measured on this machine (:func:`choose_kernels`) and cached like the fp32 matmul plan.
"""

from __future__ import annotations

import importlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import watch
from .gguf_blocks import dequantize_q4, dequantize_q8

WEIGHTS = ("auto", "fp32", "int8", "int4")
GROUP = 32
STOCK_KERNEL = {"q4": "int4pack", "q8": "int8pack"}


class QuantLinear(nn.Module):
    """Base of the weight-only quantized linears: (..., K) float -> (..., N) float32."""

    kernel = "?"
    # row_invariant: each output row is computed the same way whatever the number of rows (needed for
    # greedy speculative output == plain greedy output); checked by tests for the stock kernels
    row_invariant = True

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.weight: Tensor | None = None  # optional float reference (the tied lm_head keeps the embedding)

    def mm(self, x: Tensor) -> Tensor:
        """x (M, K) float32 -> (M, N) float32."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        y = self.mm(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        """Bytes of weight data one forward streams."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "bias")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class Int4PackLinear(QuantLinear):
    """Group-32 4-bit weights through ``aten._weight_int4pack_mm_for_cpu`` (bf16 activations on x86)."""

    kernel = "int4pack"

    def __init__(
        self,
        scale: Tensor,
        minv: Tensor,
        q: Tensor,
        bias: Tensor | None = None,
        scale_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        n, k = q.shape
        super().__init__(k, n, bias)
        if n % 16 or k % GROUP:
            raise ValueError(f"int4pack needs rows % 16 == 0 and columns % {GROUP} == 0, got {n}x{k}")
        # aten: w = (q - 8) * scale + zero  <=>  scale * q + minv with zero = minv + 8 * scale
        zero = minv.float() + 8.0 * scale.float()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2))
        # (K/32, N, 2): scale, zero of group g for output n
        self.register_buffer(
            "scales_and_zeros", torch.stack((scale.float().t(), zero.t()), dim=-1).to(scale_dtype).contiguous()
        )

    def mm(self, x: Tensor) -> Tensor:
        xs = x.to(self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xs, self.packed, GROUP, self.scales_and_zeros).float()

    def dequantized(self) -> Tensor:
        """The weights (N, K) as the kernel returns them for a unit input (bf16 scales: rounded to bf16)."""
        eye = torch.eye(self.in_features, dtype=self.scales_and_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_and_zeros).float().t()


class Int8PackLinear(QuantLinear):
    """Per-output-row int8 weights through ``aten._weight_int8pack_mm`` (bf16 activations on x86).

    Scales are chosen bf16-representable (rounded up, so nothing clips): the weights this module
    multiplies by are exactly ``q * scale``.
    """

    kernel = "int8pack"

    def __init__(self, w: Tensor, bias: Tensor | None = None) -> None:
        n, k = w.shape
        super().__init__(k, n, bias)
        w = w.float()
        amax = w.abs().amax(dim=1).clamp_min(1e-30)  # (N,)
        scale = _round_up_bf16(amax / 127.0)
        self.register_buffer("qweight", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale)  # (N,) bf16

    def mm(self, x: Tensor) -> Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).float()

    def dequantized(self) -> Tensor:
        """The weights (N, K) this module multiplies by, as float32."""
        return self.qweight.float() * self.scales.float()[:, None]


def _round_up_bf16(x: Tensor) -> Tensor:
    """The smallest bf16 values >= x (positive x)."""
    b = x.to(torch.bfloat16)
    low = b.float() < x
    return torch.where(low, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


class NativeLinear(watch.WatchedAttrs, QuantLinear):
    """A q4/q8 weight packed by the optional native kernel package ``treedraft.kernels``."""

    WATCHED = ("packed",)  # read by the fused decoder, not a registered attribute (watch.py)

    kernel = "native"

    def __init__(self, fmt: str, parts: tuple[Tensor, ...], bias: Tensor | None, kernels) -> None:
        n, k = parts[-1].shape
        super().__init__(k, n, bias)
        self._k = kernels
        self.packed = kernels.pack_q4_1(*parts) if fmt == "q4" else kernels.pack_q8_0(*parts)

    def mm(self, x: Tensor) -> Tensor:
        return self._k.mm(x.float().contiguous(), self.packed)

    def nbytes(self) -> int:
        # what the kernel streams: the packed blocks with their fp16 scales (the parts' scales may be float32,
        # which counted 111.5 MB for the int4 SmolLM2 against the 96.4 MB the kernel reads)
        return self.packed.nbytes


def native_kernels():
    """The native kernel package when it is installed and usable on this CPU, else None."""
    try:
        k = importlib.import_module("treedraft.kernels")
    except ImportError:
        return None
    try:
        return k if k.available() else None
    except Exception as e:
        warnings.warn(f"treedraft.kernels is installed but unusable ({e}); using PyTorch's stock kernels", stacklevel=2)
        return None


@dataclass
class QWeight:
    """One linear's weight in a quantized format: ``fmt`` 'q4' (scale, minv, q) or 'q8' (scale, q)."""

    fmt: str
    parts: tuple[Tensor, ...]
    source: str  # where it came from, e.g. 'gguf Q4_1', 'rtn from F32'

    def dequantize(self) -> Tensor:
        """float32 (N, K)."""
        return dequantize_q4(*self.parts) if self.fmt == "q4" else dequantize_q8(*self.parts)


def _as_fp16(scale: Tensor) -> Tensor:
    """Positive scales as the nearest fp16 values (subnormals included), never 0: the smallest fp16 instead."""
    h = scale.to(torch.float16).float()
    return torch.where(h > 0, h, torch.full_like(h, 2.0**-24))


def quantize_q4_rtn(w: Tensor) -> QWeight:
    """Round-to-nearest asymmetric group-32 4-bit (Q4_1-style min/max) from float weights (N, K)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    # scale and minimum as the packed format stores them (fp16, as GGUF's d and m): the codes are rounded against
    # the values the kernels will use, so the packed weights are exactly code * scale + min
    lo = lo.to(torch.float16).float()
    scale = _as_fp16((hi - lo) / 15.0)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return QWeight("q4", (scale, lo, q), "rtn4")


def quantize_q8_rtn(w: Tensor) -> QWeight:
    """Round-to-nearest symmetric group-32 int8 (Q8_0-style) from float weights (N, K)."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    # the scale as the packed format stores it (fp16, as GGUF's d; see quantize_q4_rtn)
    scale = _as_fp16(g.abs().amax(-1) / 127.0)
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QWeight("q8", (scale, q), "rtn8")


def build_linear(qw: QWeight, kernel: str, bias: Tensor | None = None, natives=None) -> QuantLinear:
    """A module for ``qw`` served by ``kernel`` ('int4pack', 'int8pack' or 'native')."""
    if kernel == "native":
        if natives is None:
            raise ValueError("kernel 'native' needs the treedraft.kernels package")
        return NativeLinear(qw.fmt, qw.parts, bias, natives)
    if kernel == "int4pack":
        if qw.fmt != "q4":
            raise ValueError(f"int4pack serves q4 weights, not {qw.fmt}")
        return Int4PackLinear(*qw.parts, bias=bias)
    if kernel == "int8pack":
        return Int8PackLinear(qw.dequantize(), bias)
    raise ValueError(f"unknown kernel {kernel!r}; use int4pack, int8pack or native")


def candidates(fmt: str, natives) -> list[str]:
    """Kernels that can serve format ``fmt`` here: the stock one, plus 'native' when it is available."""
    return [STOCK_KERNEL[fmt]] + (["native"] if natives is not None else [])


def rows_match(mod: nn.Module, k: int, rows: int = 16, seed: int = 0) -> bool:
    """Whether each row of a ``rows``-row product equals, bit for bit, the same row computed alone."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        full = mod(x)
        return all(torch.equal(full[i : i + 1], mod(x[i : i + 1])) for i in range(rows))


def time_modules(
    mods: list[nn.Module], rows: int, reps: int = 3, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Min over ``reps`` of the seconds (``clock``) to run every module once on ``rows`` random rows."""
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in mods}
    best = float("inf")
    with torch.inference_mode():
        for m in mods:  # warm-up
            m(xs[m.in_features])
        for _ in range(reps):
            t = clock()
            for m in mods:
                m(xs[m.in_features])
            best = min(best, clock() - t)
    return best


def choose_kernels(
    weights: dict[str, QWeight], natives, log: Callable[[str], None] | None = None, rows: tuple[int, ...] = (1, 16)
) -> dict[str, str]:
    """Per format present in ``weights``: the fastest row-invariant candidate kernel, measured here.

    One kernel serves every row count of a format (a per-row-count choice would make tree rows differ
    from 1-token rows). A candidate whose rows change with the row count is refused, with a log line.
    """
    out: dict[str, str] = {}
    for fmt in sorted({qw.fmt for qw in weights.values()}):
        cands = candidates(fmt, natives)
        if len(cands) == 1:
            out[fmt] = cands[0]
            continue
        sample = [qw for qw in weights.values() if qw.fmt == fmt]
        best, best_t = cands[0], float("inf")
        for c in cands:
            try:
                mods = [build_linear(qw, c, None, natives) for qw in sample]
            except (ValueError, RuntimeError) as e:
                if log:
                    log(f"kernel {c} cannot serve {fmt}: {e}")
                continue
            if not rows_match(mods[0], mods[0].in_features):
                if log:
                    log(f"kernel {c} refused for {fmt}: its rows change with the number of rows")
                continue
            t = sum(time_modules(mods, r) for r in rows)
            if log:
                log(f"{fmt} {c}: {t * 1e3:.1f} ms for rows {rows}")
            if t < best_t:
                best, best_t = c, t
        out[fmt] = best
    return out


def choose_q4_pair(
    mods: list[nn.Module],
    natives,
    log: Callable[[str], None] | None = None,
    rows: tuple[int, ...] = (8, 16),
    reps: int = 5,
) -> bool | None:
    """Whether the native Q4_1 GEMM runs full tiles in pairs (the 32-column kernel) on this machine, measured here.

    Both settings time ``mods`` (the model's native q4 linears, as swapped in) at ``rows`` rows (tree and batched
    steps; a 1-row step streams its weights and does not care), alternating, min of ``reps``, on one thread in that
    thread's CPU time: what is measured is the kernels' cost, which the other core's load on a shared machine would
    otherwise swamp (two-thread wall times flipped either way there). The faster wins. Either gives the same bits.
    None where it does not apply (no native q4 linear, or a build without the pair kernel).
    """
    if natives is None or not mods or not natives.q4_pair_supported():
        return None
    best = {False: float("inf"), True: float("inf")}
    threads = natives.get_num_threads()
    natives.set_num_threads(1)
    try:
        for _ in range(reps):
            for on in (False, True):
                natives.set_q4_pair(on)
                best[on] = min(best[on], sum(time_modules(mods, r, 1, time.thread_time) for r in rows))
    finally:
        natives.set_q4_pair(True)
        natives.set_num_threads(threads)
    if log:
        log(f"q4 tiles for rows {rows}: single {best[False] * 1e3:.1f} ms, paired {best[True] * 1e3:.1f} ms")
    return best[True] < best[False]


def swap_linears(model: nn.Module, weights: dict[str, QWeight], kernels: dict[str, str], natives=None) -> None:
    """Replace the named Linear submodules of ``model`` by quantized ones (``kernels``: format -> kernel).

    A q4 weight whose shape the int4 kernel cannot take (rows not a multiple of 16) falls back to int8pack
    with a warning naming it.
    """
    for name, qw in weights.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        bias = getattr(old, "bias", None)
        kernel = kernels[qw.fmt]
        try:
            new = build_linear(qw, kernel, bias, natives)
        except ValueError as e:
            if kernel != "int4pack":
                raise
            warnings.warn(f"{name}: {e}; served by int8pack (per-row int8) instead", stacklevel=2)
            new = build_linear(qw, "int8pack", bias, natives)
        if name == "lm_head":
            new.weight = old.weight.detach()  # float reference for drafters that project with it
        setattr(parent, attr, new)
    if any(isinstance(m, NativeLinear) for m in model.modules()):
        # int8 activations amplify SDPA's tree-vs-plain rounding differences into different tokens:
        # decode steps switch to the row-invariant native attention
        for m in model.modules():
            if isinstance(getattr(type(m), "exact_attention", None), bool):
                m.exact_attention = True


def weight_bytes(model: nn.Module) -> int:
    """Bytes of linear weights one forward reads (quantized modules count their packed data)."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.nbytes()
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total

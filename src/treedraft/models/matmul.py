"""The per-row-count matmul plan of the float32 CPU path: the row-invariant native kernel (``EXACT``, the default
with the extension), or three BLAS kernels timed per machine."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# every row count up to 16 (tree sizes on a CPU) gets its own entry, larger ones share a bucket
MATMUL_BUCKETS = (*range(1, 17), 24, 32, 48, 64)
MATMUL_STRATEGIES = ("linear", "xwt", "wxt")
# kernels.mm_f32 (kernels/f32mm.h): every row computed the same way whatever the row count, so a tree row equals
# the 1-token row bitwise (BLAS changes its blocking with the row count); the fp32 path's plan when the native
# extension is there (models/plan.py: pack_tuned), for every bucket up to 64 rows (decode steps and trees)
EXACT = "exact"


def _padded_candidates(rows: int) -> list[str]:
    """Kernels for ``rows`` rows, including ``name@p``: pad x with zero rows to p, drop them after.

    Measured here: MKL's skinny GEMM runs 4, 8 and 16 rows at full speed but 13-15 rows up to 1.8x
    slower than 16 (the microkernel width), so a 15-node tree cost more than a 16-node one.
    """
    out = list(MATMUL_STRATEGIES)
    if rows > 16:  # buckets above 16 are measured at the bucket size: pad every row count up to it
        return [f"{s}@{rows}" for s in out]
    for mult in (4, 8, 16):
        p = -(-rows // mult) * mult
        if p > rows and f"wxt@{p}" not in out:
            out.append(f"wxt@{p}")
    return out


def _bucket(rows: int) -> int:
    for b in MATMUL_BUCKETS:
        if rows <= b:
            return b
    return 0  # larger than every bucket: plain F.linear


def matmul(strategy: str, x: Tensor, w: Tensor, wt: Tensor | None) -> Tensor:
    """x (M, K) times w (N, K)^T by one of three equivalent kernels (results differ by float rounding).

    linear: F.linear(x, w); xwt: x @ wt with a contiguous (K, N) copy; wxt: (w @ x^T)^T, which BLAS
    runs as a GEMM with a skinny right-hand side (one row is duplicated so it never degrades to GEMV).
    """
    if strategy == EXACT:
        from treedraft import kernels

        return kernels.mm_f32(x, w)
    if strategy == "xwt" and wt is not None:
        return x @ wt
    if strategy == "wxt":
        # x^T as a column-major view of a row-major x: the layout MKL's skinny GEMM is fast on;
        # the (M, N) result is made row-major again so attention/SDPA keep their fast kernels
        xx = torch.cat((x, x)) if x.shape[0] == 1 else x.contiguous()
        return torch.mm(w, xx.t()).t()[: x.shape[0]].contiguous()
    return F.linear(x, w)


def exact_plan() -> dict[int, str]:
    """The row-invariant plan: :data:`EXACT` for every bucket (up to 64 rows); larger calls (a long prompt's
    prefill, shared by plain and speculative decoding of a request) keep F.linear."""
    return dict.fromkeys(MATMUL_BUCKETS, EXACT)


def exact_plan_available(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` can run :func:`exact_plan` here (float32 and the native extension)."""
    from treedraft import kernels

    return dtype == torch.float32 and kernels.available()


def is_exact_plan(plan: dict[int, str] | None) -> bool:
    """Whether a packed plan is :func:`exact_plan` (every bucket :data:`EXACT`)."""
    return bool(plan) and set(plan.values()) == {EXACT}


def planned_matmul(candidate: str, x: Tensor, w: Tensor, wt: Tensor | None) -> Tensor:
    """:func:`matmul` for a plan entry: ``name`` or ``name@p`` (x zero-padded to p rows, cut back after)."""
    strategy, _, pad = candidate.partition("@")
    rows = x.shape[0]
    if pad and int(pad) > rows:
        x = torch.cat((x, x.new_zeros(int(pad) - rows, x.shape[1])))
    return matmul(strategy, x, w, wt)[:rows]


class Linear(nn.Linear):
    """nn.Linear whose matmul kernel is chosen per row count by a measured plan.

    On this CPU (fp32, MKL) the three kernels of :func:`matmul` differ by up to 2x for the
    skinny inputs of decoding and tree verification (1-32 rows), and which one wins depends on
    the row count and the machine, so :meth:`Transformer.pack` times them and stores a plan.
    Without a plan (tests, training) it is plain F.linear.
    """

    weight_t: Tensor | None = None
    plan: dict[int, str] | None = None  # rows bucket -> strategy, shared by all Linear of a model

    def forward(self, x: Tensor) -> Tensor:
        if self.plan is None:
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, x.shape[-1])
        y = planned_matmul(self.plan.get(_bucket(x2.shape[0]), "linear"), x2, self.weight, self.weight_t)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def tune_matmul_plan(linears: list[Linear], reps: int = 2, buckets: tuple[int, ...] = MATMUL_BUCKETS) -> dict[int, str]:
    """Time each strategy on every weight of the model for each row bucket; return the fastest."""
    import time

    plan: dict[int, str] = {}
    for rows in buckets:
        xs = {
            k: torch.randn(rows, k, dtype=linears[0].weight.dtype, device=linears[0].weight.device)
            for k in {m.in_features for m in linears}
        }
        best, best_t = "linear", float("inf")
        for candidate in _padded_candidates(rows):
            t_min = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for m in linears:
                    planned_matmul(candidate, xs[m.in_features], m.weight, m.weight_t)
                t_min = min(t_min, time.perf_counter() - t)
            if t_min < best_t:
                best, best_t = candidate, t_min
        plan[rows] = best
    return plan

"""Are tree rows computed exactly like 1-token rows? fp32 plan kernels and attention variants (issue 11).

    python benchmarks/row_invariance.py      # prints max |diff| per variant and the cost of the exact one

Findings are written up in benchmarks/results/quant_exactness.md.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from treedraft.models.llama import planned_matmul

NH, NKV, HD, S0 = 9, 3, 64, 512
PARENT = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # a 16-node tree


def plan_kernels() -> None:
    """1-row vs 16-row results of the fp32 plan's strategies on a 1536x576 weight."""
    torch.manual_seed(0)
    w = torch.randn(1536, 576)
    wt, x = w.t().contiguous(), torch.randn(16, 576)
    for c1 in ("linear", "xwt", "wxt"):
        for c16 in ("linear", "xwt", "wxt", "wxt@16"):
            full = planned_matmul(c16, x, w, wt)
            d = max((full[i : i + 1] - planned_matmul(c1, x[i : i + 1], w, wt)).abs().max().item() for i in range(16))
            print(f"plan: 1-row {c1:6s} vs 16-row {c16:7s}: max |diff| {d:.1e}")


def attention() -> None:
    """Masked tree SDPA and a per-row gathered variant against what plain decoding computes for each row."""
    T = len(PARENT)
    anc = []
    for i in range(T):
        a, j = [], i
        while j >= 0:
            a.append(j)
            j = PARENT[j]
        anc.append(a[::-1])
    depth = [len(a) - 1 for a in anc]
    k, v, q = torch.randn(1, NKV, S0 + T, HD), torch.randn(1, NKV, S0 + T, HD), torch.randn(1, NH, T, HD)
    mask = torch.zeros(T, S0 + T, dtype=torch.bool)
    mask[:, :S0] = True
    for i in range(T):
        mask[i, [S0 + j for j in anc[i]]] = True

    def keys(i: int) -> torch.Tensor:
        return torch.tensor(list(range(S0)) + [S0 + j for j in anc[i]])

    def tree_masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)

    def tree_rowwise() -> torch.Tensor:
        out = torch.empty(1, NH, T, HD)
        for d in sorted(set(depth)):
            rows = [i for i in range(T) if depth[i] == d]
            idx = torch.stack([keys(i) for i in rows])  # (n, S)
            kk, vv = k[0][:, idx].transpose(0, 1), v[0][:, idx].transpose(0, 1)  # (n, nkv, S, hd)
            o = F.scaled_dot_product_attention(q[0][:, rows].transpose(0, 1)[:, :, None], kk, vv, enable_gqa=True)
            out[0][:, rows] = o[:, :, 0].transpose(0, 1)
        return out

    # plain decoding of row i's path: keys prefix + path in order, one query row, no mask
    plain = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, i : i + 1], k[:, :, keys(i)], v[:, :, keys(i)], enable_gqa=True)
            for i in range(T)
        ],
        2,
    )
    print(f"attention: masked tree vs plain rows: max |diff| {(tree_masked() - plain).abs().max().item():.1e}")
    print(f"attention: per-row gathered vs plain rows: bitwise equal {torch.equal(tree_rowwise(), plain)}")

    def ms(fn) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        return (time.perf_counter() - t) / 10 * 1e3

    a, b = min(ms(tree_masked) for _ in range(3)), min(ms(tree_rowwise) for _ in range(3))
    print(f"attention per layer: masked tree {a:.2f} ms, per-row gathered {b:.2f} ms ({b / a:.0f}x)")


if __name__ == "__main__":
    plan_kernels()
    attention()

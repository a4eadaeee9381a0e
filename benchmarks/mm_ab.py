"""The native quantized matmul, this tree's source vs a baseline copy, side by side in one process.

Builds ``--baseline DIR`` (or loads a built ``.so``; a copy of an older ``src/treedraft/kernels`` with the same packed layout,
e.g. ``git archive <rev> src/treedraft/kernels | tar -x -C /tmp/base``) as a second extension
module, then times both on SmolLM2-135M's fused linear shapes (qkv, wo, w13, w2 as Q4_1; lm_head as
Q8_0) for each row count, the two interleaved per repetition. Every call streams its weight from
memory (rotating through > L3 bytes of copies). Also prints the machine's read bandwidth (a
``--threads``-thread sum over 256 MB) so weight bytes / bandwidth, the 1-row floor, can be stated.
Min over repetitions (the machine may be shared); ratio = baseline / new.

    python benchmarks/mm_ab.py --baseline /tmp/base/src/treedraft/kernels [--rows 1,4,16] [--reps 7]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import treedraft.kernels as tk

H, KV, I, V = 576, 192, 1536, 49152
SHAPES = [
    ("qkv", H + 2 * KV, H, "q4_1"),
    ("wo", H, H, "q4_1"),
    ("w13", 2 * I, H, "q4_1"),
    ("w2", H, I, "q4_1"),
    ("lm_head", V, H, "q8_0"),
]  # (name, N, K, kind)
PER_FORWARD = {"qkv": 30, "wo": 30, "w13": 30, "w2": 30, "lm_head": 1}
ROTATE_BYTES = 96 << 20


def load_baseline(src: Path, threads: int):
    """The extension built from another copy of the kernel sources (module name from its path), or an
    already built module when src is a .so file (e.g. an older build under cache_dir()/kernels)."""
    if src.suffix == ".so":
        from treedraft.kernels._build import _import_built

        mod = _import_built(src, src.stem)
        mod.set_num_threads(threads)
        return mod
    from torch.utils import cpp_extension

    name = "td_qgemm_base_" + str(abs(hash(str(src.resolve()))) % 10**8)
    out = Path("/tmp") / name
    out.mkdir(exist_ok=True)
    from treedraft.kernels._build import cflags

    mod = cpp_extension.load(
        name=name,
        sources=[str(src / "qgemm.cpp")],
        # CFLAGS has -fvisibility=hidden: the baseline keeps its own thread pool even when its sources
        # predate that flag (an older prebuilt .so may not: its pool is shared with this build's)
        extra_cflags=cflags(),  # TREEDRAFT_KERNEL_MARCH applies to the baseline too
        extra_include_paths=[str(src)],
        build_directory=str(out),
        verbose=False,
    )
    mod.set_num_threads(threads)
    return mod


def weights(N: int, K: int, kind: str, g: torch.Generator, rotate: bool = True) -> list[tk.PackedWeight]:
    """Enough random packed copies of an (N, K) weight that rotating through them defeats the caches
    (one copy when not rotate: the compute cost with the weight cache-resident)."""
    B = K // 32
    d = (torch.rand(N, B, generator=g) * 0.01 + 0.001).half().float()
    if kind == "q4_1":
        m = (-torch.rand(N, B, generator=g) * 0.08).half().float()
        w = tk.pack_q4_1(d, m, torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g))
    else:
        w = tk.pack_q8_0(d, torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g))
    n = max(1, -(-ROTATE_BYTES // w.nbytes)) if rotate else 1
    return [w] + [tk.PackedWeight(w.data.clone(), w.N, w.K, w.kind) for _ in range(n - 1)]


def read_bandwidth(threads: int) -> float:
    """GB/s of a float32 sum over 256 MB with `threads` torch threads (best of 5)."""
    torch.set_num_threads(threads)
    a = torch.ones(64 << 20)
    a.sum()
    best = min(_timed(a.sum) for _ in range(5))
    return a.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="kernel source dir or built .so to compare against")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--in-cache", action="store_true", help="one weight copy (compute cost, not streaming)")
    ap.add_argument("--path", default="", help="force a code path of both modules (avx512, avx2, scalar)")
    args = ap.parse_args()
    tk.set_num_threads(args.threads)
    new = tk._ext()
    mods = {"new": new}
    if args.baseline is not None:
        mods = {"base": load_baseline(args.baseline, args.threads), "new": new}
    bw = read_bandwidth(args.threads)
    bw_pool = tk.read_bandwidth(256, 5) if hasattr(new, "read_bandwidth") else float("nan")
    print(
        f"read bandwidth, {args.threads} threads, 256 MB: torch sum {bw:.1f} GB/s, kernel pool {bw_pool:.1f} GB/s; "
        f"path {args.path or tk.paths()[0]}"
    )
    g = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    total = {(name, M): 0.0 for name in mods for M in rows}
    hdr = " | ".join(f"{n} ms" for n in mods) + (" | base/new" if len(mods) > 1 else "")
    print(f"| shape | rows | {hdr} | GB/s new |")
    print("|---" * (3 + len(mods) + (len(mods) > 1)) + "|")
    for sname, N, K, kind in SHAPES:
        if sname not in args.shapes.split(","):
            continue
        ws = weights(N, K, kind, g, rotate=not args.in_cache)
        for M in rows:
            x = torch.randn(M, K, generator=g)
            best = {n: float("inf") for n in mods}
            for mod in mods.values():  # warm-up; then the two modules must agree bitwise
                mod.mm(x, ws[0].data, N, ws[0].kind, args.path)
            if len(mods) > 1:
                a = mods["base"].mm(x, ws[0].data, N, ws[0].kind, args.path)
                b = mods["new"].mm(x, ws[0].data, N, ws[0].kind, args.path)
                if not torch.equal(a, b):
                    print(f"  note: {sname} M={M}: base and new differ (max {(a - b).abs().max().item():.3g})")
            inner = max(4 if len(ws) > 1 else 20, len(ws))
            for _ in range(args.reps):
                for n, mod in mods.items():
                    t0 = time.perf_counter()
                    for i in range(inner):
                        w = ws[i % len(ws)]
                        mod.mm(x, w.data, w.N, w.kind, args.path)
                    best[n] = min(best[n], (time.perf_counter() - t0) / inner)
            for n in mods:
                total[(n, M)] += best[n] * PER_FORWARD[sname]
            cells = " | ".join(f"{best[n] * 1e3:.3f}" for n in mods)
            ratio = f" | {best['base'] / best['new']:.2f}x" if len(mods) > 1 else ""
            print(f"| {sname} | {M} | {cells}{ratio} | {ws[0].nbytes / best['new'] / 1e9:.1f} |")
    print("\nsum over one forward's linears (30 layers + lm_head), ms:")
    for M in rows:
        cells = ", ".join(f"{n} {total[(n, M)] * 1e3:.2f}" for n in mods)
        ratio = f", base/new {total[('base', M)] / total[('new', M)]:.2f}x" if len(mods) > 1 else ""
        print(f"  rows {M}: {cells}{ratio}")


if __name__ == "__main__":
    main()

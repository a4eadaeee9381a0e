"""Two builds of the native GEMM timed side by side in one process (interleaved per repetition, one thread, thread
CPU time), and their outputs compared bit for bit: a kernel change's A/B without a second process's noise.

Build each side first (importing treedraft.kernels builds the kernel into its cache), e.g. the commit before the
Q8_0 change (87587f2~1) against this checkout, from the repository root:

    git worktree add /tmp/wt_old 87587f2~1
    TREEDRAFT_CACHE=/tmp/c_old PYTHONPATH=/tmp/wt_old/src .venv/bin/python -c "import treedraft.kernels as k; k.paths()"
    TREEDRAFT_CACHE=/tmp/c_new .venv/bin/python -c "import treedraft.kernels as k; k.paths()"
    TREEDRAFT_CACHE=/tmp/c_new .venv/bin/python benchmarks/build_ab.py /tmp/c_old /tmp/c_new --kinds q8_0,q4_1

(The test helpers imported for the random weights load this checkout's kernel too: give the script the cache of
one of the two builds, as above, or it builds a third.)
Builds are loaded straight from their cache folders (``kernels/<key>/*.so``); -fvisibility=hidden keeps each one's
thread pool and settings its own.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_kernels import packed  # random packed weights, fp16-exact scales


def load_build(cache: str):
    """The kernel module built under treedraft cache folder ``cache``."""
    found = sorted(glob.glob(f"{cache}/kernels/*/*.so"))
    if len(found) != 1:
        raise SystemExit(f"{cache}: need exactly one kernels/<key>/*.so, found {found or 'none'}")
    so = found[0]
    spec = importlib.util.spec_from_file_location(Path(so).name.split(".")[0], so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="treedraft cache folder of build A")
    ap.add_argument("new", help="treedraft cache folder of build B")
    ap.add_argument("--kinds", default="q8_0", help="comma list of q4_1, q8_0")
    ap.add_argument("--shapes", default="1536x576,49152x576", help="comma list of NxK weight shapes")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    mods = {"old": load_build(args.old), "new": load_build(args.new)}
    for m in mods.values():
        m.set_num_threads(1)
    print("| kind | N x K | rows | old ms | new ms | old / new |\n|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            pw, _, _ = packed(kind, N, K)
            for M in (int(r) for r in args.rows.split(",")):
                x = torch.randn(M, K)
                ys = {k: m.mm(x, pw.data, pw.N, pw.kind, "") for k, m in mods.items()}
                if not torch.equal(ys["old"], ys["new"]):
                    raise SystemExit(f"{kind} {shape} rows {M}: the builds' outputs differ")
                ts: dict[str, list[float]] = {k: [] for k in mods}
                for _ in range(args.reps):
                    for k, m in mods.items():
                        t = time.thread_time()
                        m.mm(x, pw.data, pw.N, pw.kind, "")
                        ts[k].append(time.thread_time() - t)
                o, n = min(ts["old"]), min(ts["new"])
                print(f"| {kind} | {N} x {K} | {M} | {o * 1e3:.3f} | {n * 1e3:.3f} | {o / n:.2f} |")


if __name__ == "__main__":
    main()

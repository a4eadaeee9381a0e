"""Decode steps of the fused native forward with a float32 vs a float16 KV cache, side by side in one process.

Two caches per dtype hold the same prefix. Step shapes on a
``--context``-token prefix (random tokens): 1 row; a 16-node binary tree (one shared prefix); ``--batch``
requests of 1 row each, every one on its own cache (the batched server's step, ``forward_packed``).
All (dtype, shape) pairs are interleaved per repetition (order reversed every other one); prints median
and min ms per step by ``--clock`` (thread: the caller's CPU time, with ``--threads 1`` all kernel work,
so other processes on a shared machine count little).

    python benchmarks/attn_kv_dtype.py [--threads 1 --clock thread] [--reps 20] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fused_latency import depths, tree_mask  # benchmarks/ is on sys.path when run as a script

import treedraft
import treedraft.kernels as tk
from treedraft.models.kvcache import Segment


def main() -> None:
    """Interleave the settings and shapes, print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--kv-dtypes", default="float32,float16")
    ap.add_argument("--batch", type=int, default=8, help="requests (own caches) in the batched step; 0: skip")
    a = ap.parse_args()
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    tk.set_num_threads(a.threads)
    m = treedraft.load(drafter=None, weights=a.weights).model
    V, ctx, nb = m.vocab_size, a.context, a.batch
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (1, ctx), generator=g)
    toks = torch.randint(0, V, (max(16, nb),), generator=g)
    caches: dict[str, list] = {}
    with torch.inference_mode():
        for kv in a.kv_dtypes.split(","):
            m.kv_dtype = getattr(torch, kv)
            caches[kv] = []
            for _ in range(max(1, nb)):  # the same prefix in each (prefill once, copy)
                c = m.new_cache(ctx + 32)
                if not caches[kv]:
                    m.forward(prompt, torch.arange(ctx), c, 0)
                    c.keep(0, range(ctx))
                else:
                    c.kv.copy_(caches[kv][0].kv)  # every layer's k and v are views of .kv
                    c.length = caches[kv][0].length
                caches[kv].append(c)

        def step(kv: str, shape: str) -> torch.Tensor:
            cs = caches[kv]
            if shape == "1 row":
                return m.forward(toks[None, :1], torch.tensor([ctx]), cs[0], ctx)[0]
            if shape == "16-row tree":
                pos = torch.tensor([ctx + d for d in depths(16)])
                return m.forward(toks[None, :16], pos, cs[0], ctx, tree_mask(16, ctx))[0]
            segs = [Segment(cache=c, start=ctx, rows=1) for c in cs[:nb]]
            return m.forward_packed(toks[:nb], torch.full((nb,), ctx), segs)[0]

        shapes = ["1 row", "16-row tree"] + ([f"{nb} caches x 1 row"] if nb > 0 else [])
        keys = [(kv, sh) for kv in caches for sh in shapes]
        for kv, sh in keys:  # warm-up
            step(kv, sh)
        times: dict[tuple, list[float]] = {k: [] for k in keys}
        for r in range(a.reps):
            for kv, sh in keys if r % 2 == 0 else reversed(keys):
                t0 = clock()
                step(kv, sh)
                times[(kv, sh)].append(clock() - t0)
    print(f"\n{a.weights}, context {ctx}, {a.threads} threads, {a.reps} reps interleaved, {a.clock} ms")
    print("| step | KV | median / min ms | first dtype / this (median) |")
    print("|---|---|---|---|")
    for sh in shapes:
        base = statistics.median(times[(next(iter(caches)), sh)])
        for kv in caches:
            t = times[(kv, sh)]
            md = statistics.median(t)
            print(f"| {sh} | {kv} | {md * 1e3:.2f} / {min(t) * 1e3:.2f} | {base / md:.3f}x |")


if __name__ == "__main__":
    main()

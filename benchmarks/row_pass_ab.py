"""Fused forward with its per-row passes over the thread pool vs on the calling thread, interleaved in one process.

The fused decoder runs residual + RMSNorm + quantization, RoPE + cache writes and silu*up + quantization as
row passes (kernels/fused.h rows()); rows of at least ``--blocks`` 32-blocks in all go over the pool,
smaller ones stay on the caller (qgemm ``set_row_pass_blocks``; no effect on bits). This times k-row decode
forwards (k = 1 and binary trees) on a ``--context``-token cache with both settings alternating per
repetition, checks that both give bitwise equal logits and hidden states, and prints median / min ms.

    python benchmarks/row_pass_ab.py [--ks 1,4,8,16] [--reps 30] [--threads 2] [--blocks 64] [--clock thread]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fused_latency import depths, tree_mask  # benchmarks/ is on sys.path when run as a script

import treedraft
import treedraft.kernels as tk
from treedraft.models import fused


def main() -> None:
    """Interleave the two settings and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ks", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=64, help="pool setting: smallest row pass in 32-blocks")
    ap.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: the caller's CPU time (its waits for a descheduled worker sleep and do not count)",
    )
    a = ap.parse_args()
    clock = time.thread_time if a.clock == "thread" else time.perf_counter
    tk.set_num_threads(a.threads)
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    if fused.decoder_for(m) is None:
        raise SystemExit(f"no fused decoder: {fused.status(m)}")
    V, ctx = m.vocab_size, a.context
    g = torch.Generator().manual_seed(0)
    cache = m.new_cache(ctx + 64)
    ks = [int(k) for k in a.ks.split(",")]
    modes: dict[str, int | None] = {"pool": a.blocks, "caller": None}
    times: dict[tuple[str, int], list[float]] = {(n, k): [] for n in modes for k in ks}
    with torch.inference_mode():
        m.forward(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        cache.keep(0, range(ctx))
        toks = torch.randint(0, V, (1, max(ks)), generator=g)
        inp = {
            k: (toks[:, :k], torch.tensor([ctx + d for d in depths(k)]), tree_mask(k, ctx) if k > 1 else None)
            for k in ks
        }
        for k in ks:
            outs = []
            for v in modes.values():
                tk.set_row_pass_blocks(v)
                outs.append(m.forward(inp[k][0], inp[k][1], cache, ctx, inp[k][2]))
            same = all(torch.equal(x, y) for x, y in zip(outs[0], outs[1], strict=True))
            print(f"k={k}: pool and caller bitwise equal: {same}")
        for rep in range(a.reps + 2):
            for k in ks:
                for n, v in modes.items():
                    tk.set_row_pass_blocks(v)
                    t0 = clock()
                    m.forward(inp[k][0], inp[k][1], cache, ctx, inp[k][2])
                    if rep >= 2:
                        times[(n, k)].append(clock() - t0)
        tk.set_row_pass_blocks(None)
    print(f"\n{a.weights}, context {ctx}, {a.threads} threads, {a.reps} reps interleaved; {a.clock} ms median / min")
    print("| rows | row passes | median / min ms | caller/pool (median) |")
    print("|---|---|---|---|")
    for k in ks:
        base = statistics.median(times[("caller", k)])
        for n in modes:
            t = times[(n, k)]
            print(
                f"| {k} | {n} | {statistics.median(t) * 1e3:.2f} / {min(t) * 1e3:.2f} | {base / statistics.median(t):.3f}x |"
            )


if __name__ == "__main__":
    main()

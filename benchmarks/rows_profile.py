"""Per-op profile of the fused native forward at 1, 2, 4, 8 and 16 rows (tree verification / batch cost).

Each k-row forward (k = 1: one token; k > 1: a binary tree, parent of i is (i - 1) // 2) runs on top of a
``--context``-token KV cache of the bundled model; the row counts are interleaved per repetition. Per
forward it records the wall time of ``model.forward`` (Python included) and the C++ phase timers of
``FusedDecoder`` (``set_profile``): other (norms, RoPE, KV writes, silu, residuals and the layers' activation
quantization fused with them, as row passes), the linears (the lm_head's own quantization split out), the
attention and the lm_head. "outside" = forward wall - sum of the phases (Python wrapper, argument packing,
mask parsing, embedding lookup, cos/sin). Prints per-phase medians over ``--reps`` (and the minimum total).

    python benchmarks/rows_profile.py [--weights int4] [--context 512] [--reps 20] [--rows 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from fused_latency import depths, tree_mask  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.models import fused

PHASES = ["other", "qkv", "attention", "wo", "w13", "w2", "lm_head"]


def profile(m, ctx: int, ks: list[int], reps: int) -> dict[int, list[list[float]]]:
    """Per row count k, per repetition: [forward wall ms, the 7 PHASES' ms, the lm_head's quantize ms] of a k-row
    forward on a ``ctx``-token cache of model ``m`` (fused native decoder; row counts interleaved per repetition,
    3 warm-up repetitions dropped)."""
    os.environ[fused.ENV_DISABLE] = "0"
    V = m.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = m.new_cache(ctx + 128)
    rec: dict[int, list[list[float]]] = {k: [] for k in ks}
    with torch.inference_mode():
        m.forward(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        cache.keep(0, range(ctx))
        toks = torch.randint(0, V, (1, max(ks)), generator=g)
        inputs = {
            k: (toks[:, :k], torch.tensor([ctx + d for d in depths(k)]), None if k == 1 else tree_mask(k, ctx))
            for k in ks
        }
        dec = fused.decoder_for(m)
        if dec is None:
            raise SystemExit(f"fused decoder unavailable: {fused.status(m)}")
        dec.set_profile(True)
        for rep in range(reps + 3):
            for k in ks:
                t, p, mk = inputs[k]
                dec.take_timings()
                dec.take_quant_timing()
                t0 = time.perf_counter()
                m.forward(t, p, cache, ctx, mk)
                wall = (time.perf_counter() - t0) * 1e3
                ph = dec.take_timings()
                q = dec.take_quant_timing()
                if rep >= 3:  # warm-up
                    rec[k].append([wall, *ph, q])
        dec.set_profile(False)
    return rec


def main() -> None:
    """Run the interleaved per-row-count profile and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=args.weights)
    m = llm.model
    print("fused status:", fused.status(m) or "on", "| threads", torch.get_num_threads())
    ctx = args.context
    ks = [int(k) for k in args.rows.split(",")]
    rec = profile(m, ctx, ks, args.reps)
    cols = ["total (min)", "total", "outside", "other", "quantize", "q4 GEMM", "attention", "lm_head"]
    print(f"\n{args.weights}, context {ctx}, {args.reps} reps interleaved, ms per forward (median; total also min)")
    print("| rows | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for k in ks:
        r = rec[k]
        med = [statistics.median(x[i] for x in r) for i in range(len(r[0]))]
        wall, ph, q = med[0], med[1:8], med[8]
        lin = sum(ph[i] for i in (1, 3, 4, 5))
        outside = statistics.median(x[0] - sum(x[1:8]) for x in r)
        vals = [min(x[0] for x in r), wall, outside, ph[0], q, lin - q, ph[2], ph[6]]
        print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    print(
        "\nquantize = activation quantization inside mm_into (calling thread): the lm_head's (and the EAGLE fc's); "
        "the layers' quantization is fused into the row passes and counted in other (fused.h); "
        "q4 GEMM = qkv+wo+w13+w2 phases minus quantize"
    )


if __name__ == "__main__":
    main()

"""Fused decode step A/B for the attention, side by side in one process.

``--compare gemm``: the AVX-512 block-GEMM attention (kernels/attn_gemm.h) off (old) and on (new); both
give the same bits. ``--compare kv``: a float32 (old) and a float16 (new) KV cache holding the same
prefix (kernels/attn_kv.h; fp16 rounds the stored keys/values). ``--compare pair``: the Q4_1 GEMM's full tiles
one by one (old) or in pairs through the 32-column kernel (new; kernels/kern_avx512.h, same bits), float16 cache;
the phase column is then the linears (q/k/v, o, gate/up, down). ``--compare widen``: the score pass on a float16
cache widening each key row per query pair (old) or each 16-key chunk once from 36 queries on (new;
kernels/attn_gemm.h, same bits). For each row count k (k = 1: a plain
step; k > 1: a binary tree of k nodes) on a ``--context``-token cache of the bundled model, the two
settings alternate per repetition. Reports per setting the median of the caller thread's CPU time
(``--clock thread``, with ``--threads 1``: all kernel work runs on the caller, and other processes' load
on a shared machine does not count) or of wall time, the old/new ratio, and the attention phase (C++
phase timer, wall) with its GFLOP/s.

    python benchmarks/attn_ab.py [--compare gemm|kv|pair|widen] [--weights int4] [--context 512] [--ks 1,4,16] [--reps 15]
                                 [--threads 1] [--clock thread|wall]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import treedraft
import treedraft.kernels as tk
from treedraft.models import fused


def tree_mask(n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary tree of n nodes after ``start`` tokens: positions (n,), mask (n, start + n)."""
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, start + j] = True
            j = (j - 1) // 2 if j > 0 else -1
    return torch.tensor([start + (i + 1).bit_length() - 1 for i in range(n)]), mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ks", default="1,4,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["thread", "wall"], default="thread")
    ap.add_argument("--compare", choices=["gemm", "kv", "pair", "widen"], default="gemm")
    args = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=args.weights)
    m, ctx = llm.model, args.context
    tk.set_num_threads(args.threads)
    ext, dec = tk._ext(), fused.decoder_for(m)
    if dec is None or not hasattr(ext, "set_attn_block_gemm") or not hasattr(ext, "set_attn_widen_keys"):
        raise SystemExit(f"needs the fused decoder and an AVX-512 build ({fused.status(m)})")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    cfg = m.config
    ks = [int(k) for k in args.ks.split(",")]
    g = torch.Generator().manual_seed(0)
    caches = {}
    for on in (False, True):
        m.kv_dtype = (
            torch.float16 if (on and args.compare == "kv") or args.compare in ("pair", "widen") else torch.float32
        )
        caches[on] = m.new_cache(ctx + max(ks) + 1)
    m.kv_dtype = None

    def setting(on: bool):
        """The cache of setting ``on`` (and the attention GEMM / Q4_1 pair switches)."""
        ext.set_attn_block_gemm(on or args.compare != "gemm")
        ext.set_q4_pair(on or args.compare != "pair")
        ext.set_attn_widen_keys(on or args.compare != "widen")
        return caches[on or args.compare in ("pair", "widen")]

    res: dict[tuple[int, bool], list[float]] = {(k, on): [] for k in ks for on in (False, True)}
    att: dict[tuple[int, bool], float] = {}
    with torch.inference_mode():
        prompt = torch.randint(0, m.vocab_size, (1, ctx), generator=g)
        for cache in caches.values():
            m.forward(prompt, torch.arange(ctx), cache, 0)
            cache.keep(0, range(ctx))
        for k in ks:
            toks = torch.randint(0, m.vocab_size, (1, k), generator=g)
            pos, mask = (torch.tensor([ctx]), None) if k == 1 else tree_mask(k, ctx)
            outs = []
            for on in (False, True):
                outs.append(m.forward(toks, pos, setting(on), ctx, mask)[0])
            if args.compare != "kv":
                assert torch.equal(outs[0], outs[1]), f"{args.compare} changed the logits"
            else:
                diff = (outs[0] - outs[1]).abs().max().item()
                print(f"k={k}: max |logit fp32 kv - fp16 kv| = {diff:.3g}")
            for r in range(args.reps):
                for on in (False, True) if r % 2 else (True, False):
                    cache = setting(on)
                    t0 = clock()
                    m.forward(toks, pos, cache, ctx, mask)
                    res[(k, on)].append(clock() - t0)
            phases = [1, 3, 4, 5] if args.compare == "pair" else [2]  # the linears, or attention (fused.PHASES)
            for on in (False, True):  # that phase alone (C++ timer, wall)
                cache = setting(on)
                dec.set_profile(True)
                dec.take_timings()
                for _ in range(args.reps):
                    m.forward(toks, pos, cache, ctx, mask)
                t = dec.take_timings()
                att[(k, on)] = sum(t[i] for i in phases) / args.reps
                dec.set_profile(False)
    ext.set_attn_block_gemm(True)
    ext.set_q4_pair(True)
    ext.set_attn_widen_keys(True)
    flop_per_row = cfg.num_heads * ctx * cfg.head_dim * 4 * len(m.layers)  # QK and PV, 2 flop each
    what = {
        "gemm": "block GEMM off/on",
        "kv": "float32/float16 KV cache",
        "pair": "Q4_1 tiles single/paired",
        "widen": "keys widened per query pair/per chunk",
    }
    what = what[args.compare]
    name = "linears" if args.compare == "pair" else "attention"
    print(f"{what}; {args.weights}, context {ctx}, threads {args.threads}, {args.clock} clock, {args.reps} reps")
    print(f"| rows | step old ms | step new ms | old/new | {name} old ms | new ms | new GFLOP/s | share new |")
    print("|---|---|---|---|---|---|---|---|")
    for k in ks:
        o, n = statistics.median(res[(k, False)]) * 1e3, statistics.median(res[(k, True)]) * 1e3
        ratios = [a / b for a, b in zip(res[(k, False)], res[(k, True)], strict=True)]
        ao, an = att[(k, False)], att[(k, True)]
        print(
            f"| {k} | {o:.2f} | {n:.2f} | {statistics.median(ratios):.2f}x | {ao:.2f} | {an:.2f} | "
            f"{'-' if args.compare == 'pair' else f'{k * flop_per_row / an / 1e6:.1f}'} | {an / n:.0%} |"
        )


if __name__ == "__main__":
    main()

"""Per-phase time of the fused decode step across contexts and row counts (issue 11, attention).

For each ``--contexts`` value, a KV cache of that many tokens of the bundled model, then fused forwards
of k rows (k = 1: a plain step; k > 1: a binary tree of k nodes) with the C++ phase timers on. Prints
the mean ms per phase (attention, the rest, total) per (context, rows). Compare two builds by running
this script under each (e.g. ``PYTHONPATH=<checkout>/src``) one after the other, repeatedly.

    python benchmarks/attn_latency.py [--weights int4] [--contexts 128,512,2048] [--ks 1,16,64] [--reps 10]
"""

from __future__ import annotations

import argparse
import os

import torch

import treedraft
from treedraft.models import fused


def tree(n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Binary tree of n nodes after ``start`` tokens: positions (n,), mask (n, start + n)."""
    mask = torch.zeros(n, start + n, dtype=torch.bool)
    mask[:, :start] = True
    depth = []
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, start + j] = True
            j = (j - 1) // 2 if j > 0 else -1
        depth.append((i + 1).bit_length() - 1)
    return torch.tensor([start + d for d in depth]), mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--ks", default="1,16,64")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    os.environ[fused.ENV_DISABLE] = "0"
    llm = treedraft.load(drafter=None, weights=args.weights)
    m = llm.model
    dec = fused.decoder_for(m)
    if dec is None:
        raise SystemExit(f"no fused decoder: {fused.status(m)}")
    ks = [int(k) for k in args.ks.split(",")]
    g = torch.Generator().manual_seed(0)
    names = ["other", "qkv", "attention", "wo", "w13", "w2", "lm_head"]
    print(f"{args.weights}, threads {torch.get_num_threads()}, {args.reps} reps, mean ms per fused step")
    print("| context | rows | attention | other | total |")
    print("|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        cache = m.new_cache(ctx + max(ks) + 1)
        with torch.inference_mode():
            m.forward(torch.randint(0, m.vocab_size, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
            cache.keep(0, range(ctx))
            for k in ks:
                toks = torch.randint(0, m.vocab_size, (1, k), generator=g)
                pos, mask = (torch.tensor([ctx]), None) if k == 1 else tree(k, ctx)
                for _ in range(2):
                    m.forward(toks, pos, cache, ctx, mask)
                dec.set_profile(True)
                dec.take_timings()
                for _ in range(args.reps):
                    m.forward(toks, pos, cache, ctx, mask)
                ph = dict(zip(names, (t / args.reps for t in dec.take_timings()), strict=True))
                dec.set_profile(False)
                print(f"| {ctx} | {k} | {ph['attention']:.2f} | {ph['other']:.2f} | {sum(ph.values()):.2f} |")


if __name__ == "__main__":
    main()

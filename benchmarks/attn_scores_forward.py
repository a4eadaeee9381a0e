"""One fused int4 decode forward with float32 against bf16 attention scores, by tree rows, interleaved.

On a ``--context``-token cache of random tokens: a causal chain of k rows (1, 2, 4, 8, 16), both modes alternating
(the fused decoder's switch, no rebuild), median ms of ``--reps``; then the phase profile of each (attention ms).

    python benchmarks/attn_scores_forward.py [--context 800] [--reps 30]

Session 35 (Zen 4, 2 threads): at 800 tokens 1-2 rows 0.99-1.02x, 4 rows 0.98x, 8 rows 0.93-0.95x, 16 rows
0.94-0.95x (attention 6.48 -> 5.53 ms); at 2,048 tokens 8 rows 0.91x, 16 rows 0.90x.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import treedraft
from treedraft.models import fused

PHASES = ["other", "qkv", "attention", "wo", "w13", "w2", "lm_head"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=800)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1,2,4,8,16")
    a = ap.parse_args()
    torch.set_num_threads(2)
    llm = treedraft.load(drafter=None, weights="int4", attn_scores="bf16")
    m, ctx = llm.model, a.context
    ks = [int(k) for k in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    cache = m.new_cache(ctx + max(ks))
    dec = fused.decoder_for(m)
    if dec is None:
        raise SystemExit(f"needs the fused decoder ({fused.status(m)})")
    with torch.inference_mode():
        m.forward(torch.randint(0, m.vocab_size, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        toks = torch.randint(0, m.vocab_size, (1, max(ks)), generator=g)
        inp = {
            k: (toks[:, :k], torch.arange(ctx, ctx + k), torch.ones(k, ctx + k, dtype=torch.bool).tril(ctx)) for k in ks
        }
        res: dict[tuple[int, bool], list[float]] = {(k, b): [] for k in ks for b in (False, True)}
        for r in range(a.reps):
            for bf16 in (False, True) if r % 2 else (True, False):
                dec.set_bf16_scores(bf16)
                for k in ks:
                    t0 = time.perf_counter()
                    m.forward(*inp[k][:2], cache, ctx, inp[k][2])
                    res[(k, bf16)].append(time.perf_counter() - t0)
        print(f"int4, {ctx}-token cache, {a.reps} reps interleaved (median ms)")
        print("| rows | float32 scores | bf16 scores | bf16 / float32 |\n|---|---|---|---|")
        for k in ks:
            x, y = (statistics.median(res[(k, b)]) * 1e3 for b in (False, True))
            print(f"| {k} | {x:.2f} | {y:.2f} | {y / x:.3f} |")
        dec.set_profile(True)
        print("\nattention phase, mean ms (of the step)")
        for bf16 in (False, True):
            dec.set_bf16_scores(bf16)
            for k in ks:
                dec.take_timings()
                for _ in range(a.reps):
                    m.forward(*inp[k][:2], cache, ctx, inp[k][2])
                ph = [t / a.reps for t in dec.take_timings()]
                mode = "bf16" if bf16 else "float32"
                print(f"{mode} rows {k}: attention {ph[PHASES.index('attention')]:.2f} of {sum(ph):.2f}")
        dec.set_profile(False)


if __name__ == "__main__":
    main()

"""Per-linear phase profile of fused decode forwards: k-row trees on one cache and N caches x 1 row.

Like ``rows_profile.py`` but split per linear (qkv, wo, w13, w2, lm_head) and with the batched server's step
(``--batch``: N requests' caches of ``--context`` tokens, one new row each, one packed forward). All cases are
interleaved per repetition; prints medians (and the minimum wall time) in ms.

    python benchmarks/step_phases.py [--rows 1,4,8,12,16] [--batch 1,8] [--context 512] [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fused_latency import depths, tree_mask  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.models import fused
from treedraft.models.llama import Segment

NAMES = ["other", "qkv", "attn", "wo", "w13", "w2", "lm"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", default="1,4,8,12,16", help="tree sizes on one cache")
    ap.add_argument("--batch", default="", help="N caches x 1 row cases, e.g. 1,8")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    m = treedraft.load(drafter=None, weights=a.weights).model
    dec = fused.decoder_for(m)
    if dec is None:
        raise SystemExit(f"fused decoder unavailable: {fused.status(m)}")
    V, ctx = m.vocab_size, a.context
    g = torch.Generator().manual_seed(0)
    ks = [int(k) for k in a.rows.split(",") if k]
    bs = [int(b) for b in a.batch.split(",") if b]
    cases = {}
    with torch.inference_mode():
        caches = []
        for _ in range(max([1, *bs])):
            c = m.new_cache(ctx + max([1, *ks]) + 8)
            m.forward(torch.randint(0, V, (1, ctx), generator=g), torch.arange(ctx), c, 0)
            c.keep(0, range(ctx))
            caches.append(c)
        for k in ks:
            pos = torch.tensor([ctx + d for d in depths(k)])
            seg = [Segment(caches[0], ctx, k, None if k == 1 else tree_mask(k, ctx))]
            cases[f"1x{k}"] = (torch.randint(0, V, (k,), generator=g), pos, seg)
        for b in bs:
            seg = [Segment(caches[i], ctx, 1, None) for i in range(b)]
            cases[f"{b}x1"] = (torch.randint(0, V, (b,), generator=g), torch.full((b,), ctx), seg)
        dec.set_profile(True)
        rec: dict[str, list[list[float]]] = {n: [] for n in cases}
        for rep in range(a.reps + 5):
            for n, (t, p, s) in cases.items():
                dec.take_timings()
                t0 = time.perf_counter()
                m.forward_packed(t, p, s)
                wall = (time.perf_counter() - t0) * 1e3
                ph = dec.take_timings()
                if rep >= 5:  # warm-up
                    rec[n].append([wall, *ph])
        dec.set_profile(False)
    print(f"{a.weights}, context {ctx}, {a.reps} reps interleaved; ms (median; wall also min). NxR = N caches x R rows")
    print("| case | wall | min | " + " | ".join(NAMES) + " |")
    print("|---" * (len(NAMES) + 3) + "|")
    for n, r in rec.items():
        med = [statistics.median(x[i] for x in r) for i in range(len(r[0]))]
        cells = [f"{med[0]:.2f}", f"{min(x[0] for x in r):.2f}", *(f"{v:.2f}" for v in med[1:])]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

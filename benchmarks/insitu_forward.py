"""Forward time by row count as decoding meets it: the model's packed forward wrapped and timed while ``generate`` runs
MT-Bench first turns with each method, against the latency curve the tree sizing reads (``measure_latency``).

On session 41's Xeon (L3 300 MB) plain decoding's 1-row forward took 3.5 ms while the curve read 5.5 ms, and the
default's 4-row steps 5.4 ms (1.55x plain's step) where the curve read 1.15x.

    python benchmarks/insitu_forward.py [--weights int4] [--prompts 6] [--tokens 256] [--methods none,hybrid-suffix]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import treedraft
from treedraft.prompts import MT_BENCH_FILE, find_shared_data
from treedraft.training.calibrate import measure_latency


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", default="none,hybrid-suffix")
    args = ap.parse_args()
    data = find_shared_data(MT_BENCH_FILE)
    if data is None:
        raise SystemExit(f"needs ../shared/data/{MT_BENCH_FILE} beside the checkout")
    llm = treedraft.load(weights=args.weights)
    m = llm.model
    rec: dict[int, list[float]] = collections.defaultdict(list)
    orig = m.forward_packed

    def timed(tokens, *a, **k):
        t = time.perf_counter()
        out = orig(tokens, *a, **k)
        rec[tokens.shape[-1]].append((time.perf_counter() - t) * 1e3)
        return out

    m.forward_packed = timed
    qs = [json.loads(line)["turns"][0] for line in data.open() if line.strip()][: args.prompts]
    for meth in args.methods.split(","):
        rec.clear()
        t, n = time.perf_counter(), 0
        for q in qs:
            n += len(llm.generate(q, max_new_tokens=args.tokens, drafter=meth).token_ids)
        wall = time.perf_counter() - t
        print(f"{meth}: {n / wall:.1f} tok/s; forward ms by rows (median, count):")
        for k in sorted(rec):
            if len(rec[k]) >= 5 and k <= 64:
                print(f"  {k:2d} rows: {statistics.median(rec[k]):6.2f}  ({len(rec[k])})")
    m.forward_packed = orig
    curve = measure_latency(m, 256, sizes=(1, 2, 3, 4, 5, 8, 16))
    print("latency curve (measure_latency, 256-token cache):", {k: round(v * 1e3, 2) for k, v in curve.items()})


if __name__ == "__main__":
    main()

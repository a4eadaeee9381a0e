"""The target's forward latency by rows at several cache lengths (what budget.ContextLatency models).

    python benchmarks/latency_by_context.py [--contexts 64,256,800,1600] [--passes 2] [--weights int4]

Per pass and context: each size's fastest of ``--reps`` interleaved forwards (training.calibrate.measure_latency),
in ms, and 16 rows / 1 row.
"""

from __future__ import annotations

import argparse

import treedraft
from treedraft.training.calibrate import measure_latency


def main() -> None:
    """Print one line per (pass, context)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="64,256,800,1600")
    ap.add_argument("--sizes", default="1,2,3,4,6,8,12,16,24,32")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--weights", default="int4")
    a = ap.parse_args()
    model = treedraft.load(weights=a.weights, drafter=None).engine.model
    sizes = [int(s) for s in a.sizes.split(",")]
    for _ in range(a.passes):
        for ctx in (int(c) for c in a.contexts.split(",")):
            lat = measure_latency(model, ctx, sizes, reps=a.reps)
            ratio = f"  16/1 {lat[16] / lat[1]:.2f}" if 16 in lat and 1 in lat else ""
            print(f"{ctx:5d}  " + " ".join(f"{n}:{1e3 * t:.2f}" for n, t in lat.items()) + ratio, flush=True)


if __name__ == "__main__":
    main()

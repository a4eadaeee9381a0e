"""A 1-row forward's time as a function of what ran before it: 30 back-to-back 1-row forwards after a 200 ms pause,
then after five 16-row forwards, three times (256-token cache).

On session 41's Xeon (L3 300 MB, int4 weights 96 MB) each sequence started at 6-7 ms and fell to ~3.5 ms only after
~20-30 forwards; a latency curve timed once per size in interleaved rounds reads the start of that slope.

    python benchmarks/forward_history.py [--weights int4]
"""

from __future__ import annotations

import argparse
import time

import torch

import treedraft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    args = ap.parse_args()
    m = treedraft.load(drafter=None, weights=args.weights).model
    ctx, n = 256, 16
    cache = m.new_cache(ctx + 80)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        m.forward(torch.randint(0, m.vocab_size, (1, ctx), generator=g), torch.arange(ctx), cache, 0)
        cache.keep(0, range(ctx))
        one = (torch.randint(0, m.vocab_size, (1, 1), generator=g), torch.arange(ctx, ctx + 1))
        big = (
            torch.randint(0, m.vocab_size, (1, n), generator=g),
            torch.arange(ctx, ctx + n),
            torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx),
        )

        def t1() -> float:
            t = time.perf_counter()
            m.forward(*one, cache, ctx)
            return (time.perf_counter() - t) * 1e3

        for _ in range(3):
            time.sleep(0.2)
            print("after 200 ms idle: ", " ".join(f"{t1():.1f}" for _ in range(30)))
            for _ in range(5):
                m.forward(big[0], big[1], cache, ctx, big[2])
            print("after 5 x 16 rows: ", " ".join(f"{t1():.1f}" for _ in range(30)))


if __name__ == "__main__":
    main()

"""Per-step cost of the penalties' row adjustment (penalize_ + undo) at realistic sizes: prompt / output lengths,
tree rows, a 49,152-token vocabulary (SmolLM2), random token ids below 3,000 (so many repeat).

    python benchmarks/penalties_cost.py
"""

from __future__ import annotations

import random
import time

import torch

from treedraft.penalties import Penalties, PenaltyState, penalize_


def main() -> None:
    rng = random.Random(0)
    vocab = 49152
    for plen, olen, rows in [(50, 100, 1), (300, 500, 1), (300, 500, 16), (1000, 2000, 32)]:
        prompt = [rng.randrange(3000) for _ in range(plen)]
        out = [rng.randrange(3000) for _ in range(olen)]
        logits = torch.randn(rows, vocab)
        paths = [[]] + [[rng.randrange(3000) for _ in range(rng.randint(1, 4))] for _ in range(rows - 1)]
        for pen in (Penalties(repetition=1.1), Penalties(1.1, 0.5, 0.5)):
            state = PenaltyState(pen, prompt)
            state.add(out)
            for _ in range(3):
                penalize_(logits, state, paths)()
            reps = 50
            t = time.perf_counter()
            for _ in range(reps):
                penalize_(logits, state, paths)()
            us = (time.perf_counter() - t) / reps * 1e6
            print(f"prompt {plen:5d} output {olen:5d} rows {rows:3d} slots {state.n:5d} {pen}: {us:7.0f} us")


if __name__ == "__main__":
    main()

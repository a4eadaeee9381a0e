"""How much slower Python runs right after a target forward: a fixed small NumPy workload, cold vs warm.

A decode forward streams the model's weights (~80 MB at int4) through the caches, evicting the interpreter's
code and data. Every plain greedy step here runs, right after the native forward, one small workload (the max
and argpartition of a (4, 4096) float32 array, a 50-element sort) twice: the first run is what the drafter's and
the engine's Python meets after every forward, the second the same work warm. Also ``--stream-mb``: the same
measurement after NumPy itself streams a buffer of that size, without the model.

    python benchmarks/cold_after_forward.py [--prompts 3] [--tokens 128] [--stream-mb 100]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"
X = np.random.default_rng(0).standard_normal((4, 4096)).astype(np.float32)


def work() -> float:
    """Seconds of the fixed workload."""
    t = time.perf_counter()
    X.max()
    np.argpartition(X, 4092, axis=-1)
    sorted(range(50), key=lambda i: -i)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--stream-mb", type=int, default=100)
    a = ap.parse_args()
    big = np.ones(a.stream_mb << 18, dtype=np.float32)  # stream-mb MB
    cold = warm = 0.0
    for _ in range(200):
        big.sum()
        cold += work()
        warm += work()
    numpy_only = {"cold_us": round(cold / 200 * 1e6, 1), "warm_us": round(warm / 200 * 1e6, 1)}

    import treedraft
    from treedraft.engine import GenerationConfig, GenerationStats
    from treedraft.models import fused

    llm = treedraft.load(drafter=None, weights=a.weights)
    st = fused._state(llm.model)
    acc = {"fwd": 0.0, "cold": 0.0, "warm": 0.0, "n": 0}

    class Timed:
        def __init__(self, dec) -> None:
            self.dec = dec

        def forward(self, *args, **kw):
            t = time.perf_counter()
            out = self.dec.forward(*args, **kw)
            acc["fwd"] += time.perf_counter() - t
            acc["cold"] += work()
            acc["warm"] += work()
            acc["n"] += 1
            return out

    st.decoder = Timed(st.decoder)
    for line in DATA.read_text().splitlines()[: a.prompts]:
        ids = llm.encode_prompt(json.loads(line)["turns"][0])
        with torch.inference_mode():
            for _ in llm.engine.decode(
                ids, GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True), None, GenerationStats()
            ):
                pass
    n = acc["n"]
    print(
        json.dumps(
            {
                f"after_numpy_streaming_{a.stream_mb}MB": numpy_only,
                "after_target_forward": {
                    "forward_ms": round(1e3 * acc["fwd"] / n, 3),
                    "cold_us": round(1e6 * acc["cold"] / n, 1),
                    "warm_us": round(1e6 * acc["warm"] / n, 1),
                },
            }
        )
    )


if __name__ == "__main__":
    main()

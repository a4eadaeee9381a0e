"""The fused decoder's per-step validity check: O(1) change counter (models/watch.py) vs a full slot scan.

One process, generations interleaved: "scan" forces the full check of every module/weight slot the native
decoder was built from on every step (as before watch.py), "counter" is the shipped check. Prints tokens/s
per generation and the median ratio. Greedy outputs are the same either way (checked).

    python benchmarks/decoder_check_ab.py [--drafter none] [--reps 6] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import treedraft
from treedraft.models import fused, watch
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    prompts = [p.text for p in read_prompt_file(find_shared_data(MT_BENCH_FILE))]
    llm = treedraft.load(weights=a.weights, drafter=None if a.drafter == "none" else a.drafter)
    shipped = fused._Watch.valid

    def scan(self, model) -> bool:
        watch.bump()  # the counter moved: valid() scans every slot, as every step did before watch.py
        return shipped(self, model)

    def msgs(i: int) -> list[dict]:
        return [{"role": "user", "content": prompts[i]}]

    llm.generate(msgs(0), max_new_tokens=32)
    res: dict[str, list[float]] = {"scan": [], "counter": []}
    ids: dict[str, list[list[int]]] = {"scan": [], "counter": []}
    try:
        for rep in range(a.reps):
            for mode in ("scan", "counter") if rep % 2 == 0 else ("counter", "scan"):
                fused._Watch.valid = scan if mode == "scan" else shipped
                t = time.perf_counter()
                out = llm.generate(msgs(1 + rep % 3), max_new_tokens=a.tokens)
                res[mode].append(len(out.token_ids) / (time.perf_counter() - t))
                ids[mode].append(out.token_ids)
    finally:
        fused._Watch.valid = shipped
    for mode, v in res.items():
        print(f"{mode}: median {statistics.median(v):.1f} tok/s ({', '.join(f'{x:.0f}' for x in v)})")
    print(f"counter / scan = {statistics.median(res['counter']) / statistics.median(res['scan']):.3f}x")
    print("same tokens:", ids["scan"] == ids["counter"])


if __name__ == "__main__":
    main()

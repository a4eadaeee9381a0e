"""Sampled decoding before / after the native sampler (kernels/sample.h), side by side in one process.

"before" is the step as it was: the sampling distribution by tensor ops with top-p sorting the whole row;
"after" is the current code (one native call per emitted token, the tensor fallback without whole-row sorts).
Each MT-Bench first turn runs under both arms back to back, the arm that goes first alternating per prompt;
per configuration and drafter it prints the median ms per generated token of each arm and their ratio, and
how many seeded outputs agree (both arms define the same distribution; only float rounding differs, so a
coupled draw can differ where u falls within rounding of a CDF step).

    python benchmarks/sampling_ab.py [--prompts 6] [--tokens 128] [--drafters none,hybrid] [--weights int4]

A drafter without memory across requests (not ``suffix``/``hybrid-suffix``) keeps the two arms' runs of a
prompt independent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import treedraft
from treedraft import kernels, sampling

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
CONFIGS = {
    "T0.7": dict(temperature=0.7),
    "T0.7 top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "T1.0 top_p 0.95": dict(temperature=1.0, top_p=0.95),
    "T0.7 top_k 50": dict(temperature=0.7, top_k=50),
}


def sorted_nucleus(probs, top_p):
    """The top-p filter as it was: whole rows sorted."""
    sp, si = probs.sort(-1, descending=True)
    sp = sp.masked_fill((sp.cumsum(-1) - sp) >= top_p, 0.0)
    out = probs.new_zeros(probs.shape).scatter_(-1, si, sp)
    return out / out.sum(-1, keepdim=True)


@contextlib.contextmanager
def before():
    """The step as it was before the native sampler: tensor ops, whole-row sort."""
    with (
        mock.patch.object(kernels, "sample_probs", lambda *a: None),
        mock.patch.object(kernels, "sample_draw", lambda *a: None),
        mock.patch.object(sampling, "nucleus", sorted_nucleus),
    ):
        yield


def main() -> None:
    """Run the interleaved A/B and print one table row per (configuration, drafter)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafters", default="none,hybrid")
    ap.add_argument("--weights", default="int4")
    a = ap.parse_args()
    llm = treedraft.load(weights=a.weights)
    qs = [json.loads(line)["turns"][0] for line in DATA.open()][: a.prompts]
    llm.generate(qs[0], max_new_tokens=16, drafter=None, temperature=0.7, seed=0)  # warm-up
    drafters = [None if d == "none" else d for d in a.drafters.split(",")]
    print("| configuration | drafter | before ms/token | after ms/token | speedup | same seeded output |")
    print("|---|---|---|---|---|---|")
    for name, kw in CONFIGS.items():
        for d in drafters:
            ms: dict[str, list[float]] = {"before": [], "after": []}
            same = 0
            for i, q in enumerate(qs):
                out = {}
                for arm in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    with before() if arm == "before" else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        r = llm.generate(q, max_new_tokens=a.tokens, drafter=d, seed=1000 + i, **kw)
                        ms[arm].append((time.perf_counter() - t0) * 1e3 / max(1, len(r.token_ids)))
                    out[arm] = r.token_ids
                same += out["before"] == out["after"]
            b, f = statistics.median(ms["before"]), statistics.median(ms["after"])
            print(f"| {name} | {d or 'plain'} | {b:.2f} | {f:.2f} | {b / f:.2f}x | {same}/{len(qs)} |", flush=True)


if __name__ == "__main__":
    main()

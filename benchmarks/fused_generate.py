"""Greedy generation tokens/s with the fused decode step on and off, interleaved in one process (issue 11).

Per prompt: plain and the default drafter, each once with ``TREEDRAFT_NO_FUSED=1`` (Python path) and once
fused, in alternating order; prints tok/s per (method, path), the fused/python ratio, and whether the
outputs equal plain's.

    python benchmarks/fused_generate.py [--weights int4] [--prompts 3] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import time

import treedraft
from treedraft.engine import GenerationConfig
from treedraft.models import fused

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python, with examples.",
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of inflation? Answer in three bullet points.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    llm = treedraft.load(weights=args.weights)
    eng = llm.engine
    cfg = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    tot = {}  # (method, path) -> [tokens, seconds]
    same = {"plain": 0, "hybrid": 0}
    for i, prompt in enumerate(PROMPTS[: args.prompts]):
        ids = llm.encode_prompt(prompt)
        paths = ("fused", "python") if i % 2 == 0 else ("python", "fused")
        outs = {}
        for path in paths:
            os.environ[fused.ENV_DISABLE] = "0" if path == "fused" else "1"
            for method, drafter in (("plain", None), ("hybrid", eng.drafter)):
                t = time.perf_counter()
                r = eng.generate(ids, cfg, drafter)
                dt = time.perf_counter() - t
                acc = tot.setdefault((method, path), [0, 0.0])
                acc[0] += len(r.token_ids)
                acc[1] += dt
                outs[(method, path)] = r.token_ids
        ref = outs[("plain", "fused")]
        same["plain"] += outs[("plain", "python")] == ref  # python path vs fused: may differ (rounding)
        same["hybrid"] += outs[("hybrid", "fused")] == ref  # exactness: must be equal
    os.environ.pop(fused.ENV_DISABLE, None)
    print(f"{args.weights}, {args.prompts} prompts x {args.max_new_tokens} tokens, greedy, interleaved")
    print("| method | python tok/s | fused tok/s | fused/python |")
    print("|---|---|---|---|")
    for method in ("plain", "hybrid"):
        p, f = tot[(method, "python")], tot[(method, "fused")]
        tp, tf = p[0] / p[1], f[0] / f[1]
        print(f"| {method} | {tp:.1f} | {tf:.1f} | {tf / tp:.2f}x |")
    pf, hf = tot[("plain", "fused")], tot[("hybrid", "fused")]
    print(f"fused hybrid / fused plain: {(hf[0] / hf[1]) / (pf[0] / pf[1]):.2f}x")
    print(
        f"fused hybrid output == fused plain: {same['hybrid']}/{args.prompts}; "
        f"python-path plain == fused plain: {same['plain']}/{args.prompts}"
    )


if __name__ == "__main__":
    main()

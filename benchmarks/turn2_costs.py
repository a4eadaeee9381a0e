"""Where a second turn's decode step goes, per drafter: drafting, verify forward, acceptance (issue 13).

For the first ``--prompts`` MT-Bench questions: plain greedy answers the first turn; then each method decodes
the second turn (``turns[1]`` with that answer in the context) with a fresh drafter. From the engine's per-step
stats: mean accepted tokens and tree nodes per step, ms per step in drafting / verify / the rest, and decode ms
per token (prefill excluded), whose ratios are the decode-time speedups between methods.

    python benchmarks/turn2_costs.py [--prompts 10] [--methods prompt-lookup,hybrid-suffix,hybrid]
"""

from __future__ import annotations

import argparse
import json

from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--methods", default="prompt-lookup,hybrid-suffix,hybrid")
    a = ap.parse_args()
    llm = treedraft.load(weights="int4")
    qs = [json.loads(line) for line in open(find_shared_data(MT_BENCH_FILE))][: a.prompts]
    methods = a.methods.split(",")
    agg = {m: {"tok": 0, "steps": 0, "nodes": 0, "draft": 0.0, "verify": 0.0, "rest": 0.0} for m in methods}
    for q in qs:
        _, conv = second_turn(llm, q, a.max_new)
        for m in methods:
            r = llm.generate(conv, drafter=fresh_copy(llm.get_drafter(m)), max_new_tokens=a.max_new)
            s = agg[m]
            s["tok"] += len(r.token_ids)
            s["steps"] += len(r.stats.steps)
            for st in r.stats.steps:
                s["nodes"] += st.tree_size
                s["draft"] += st.t_draft
                s["verify"] += st.t_verify
                s["rest"] += st.t_rest
    print(f"{len(qs)} second turns x {a.max_new} tokens, int4, greedy")
    print("| method | accepted / step | nodes / step | draft ms | verify ms | rest ms | decode ms / token |")
    print("|---|---|---|---|---|---|---|")
    for m, s in agg.items():
        n = s["steps"]
        per_token = 1e3 * (s["draft"] + s["verify"] + s["rest"]) / s["tok"]
        print(
            f"| {m} | {s['tok'] / n:.2f} | {s['nodes'] / n:.1f} | {1e3 * s['draft'] / n:.2f} | "
            f"{1e3 * s['verify'] / n:.2f} | {1e3 * s['rest'] / n:.2f} | {per_token:.3f} |"
        )


if __name__ == "__main__":
    main()

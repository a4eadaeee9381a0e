"""Per-step trace of a drafter on MT-Bench second turns against the copy runs in the text (issue 13).

For each step of ``--method`` on the first ``--prompts`` second turns (first turn by plain greedy decoding), the
copy run at the step's position (benchmarks/turn2_ceiling.py: the longest continuation occurring earlier in
prompt + answer), bucketed, against the step's drafted depth, accepted tokens and tree nodes; "whole chain
accepted, run longer" = the step accepted every drafted depth while the text went on copying (a chain cut short).

    python benchmarks/turn2_trace.py [--prompts 20] [--methods hybrid-suffix,hybrid]

Several methods run side by side in one process on the same conversations; "ms / token" is each bucket's step
time (draft + verify + rest) over the tokens its steps delivered (accepted + bonus).
"""

from __future__ import annotations

import argparse
import collections
import json

from turn2_ceiling import copy_runs, second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data


def bucket(run: int) -> str:
    """Label of a copy-run length."""
    return "none" if run == 0 else "1-3" if run < 4 else "4-7" if run < 8 else "8-15" if run < 16 else ">= 16"


def main() -> None:
    """Print the per-bucket table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--methods", "--method", default="hybrid-suffix", help="comma-separated drafter names")
    a = ap.parse_args()
    methods = a.methods.split(",")
    llm = treedraft.load(weights="int4")
    qs = [json.loads(line) for line in open(find_shared_data(MT_BENCH_FILE))][: a.prompts]
    aggs = {m: collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0.0, 0.0, 0.0]) for m in methods}
    for q in qs:
        _, conv = second_turn(llm, q, a.max_new)
        for m in methods:
            r = llm.generate(conv, drafter=fresh_copy(llm.get_drafter(m)), max_new_tokens=a.max_new)
            runs = copy_runs(llm.encode_prompt(conv), list(r.token_ids))
            pos = 0
            for s in r.stats.steps:
                run = runs[pos] if pos < len(runs) else 0
                t = aggs[m][bucket(run)]
                t[0] += 1
                t[1] += s.tree_depth
                t[2] += s.accepted
                t[3] += s.tree_size
                t[4] += s.accepted >= s.tree_depth and s.tree_depth < run
                t[5] += s.t_draft + s.t_verify + s.t_rest
                t[6] += s.t_draft
                t[7] += s.t_verify
                pos += s.accepted + 1
    for m in methods:
        agg = aggs[m]
        print(f"\n{m}, {len(qs)} second turns x {a.max_new}")
        print(
            "| run at the step's position | steps | drafted depth | accepted (+1 bonus) | nodes"
            " | whole chain accepted, run longer | ms / token | share of time | ms / step: draft, verify, rest |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        total = sum(t[5] for t in agg.values())
        for b in ("none", "1-3", "4-7", "8-15", ">= 16"):
            if b in agg:
                n, d, acc, nodes, short, sec, draft, verify = agg[b]
                print(
                    f"| {b} | {n} | {d / n:.2f} | {acc / n:.2f} | {nodes / n:.1f} | {short / n:.0%}"
                    f" | {1e3 * sec / (acc + n):.3f} | {sec / total:.0%}"
                    f" | {1e3 * draft / n:.2f}, {1e3 * verify / n:.2f}, {1e3 * (sec - draft - verify) / n:.2f} |"
                )


if __name__ == "__main__":
    main()

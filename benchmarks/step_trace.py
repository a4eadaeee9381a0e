"""Per-step cost of one MT-Bench prompt by tree size: plain, the default and prompt lookup, back to back.

For each method and repetition: decode ms per step, then per tree size (rows verified) the number of steps, the
mean drafting, verify and other ms per step and the tokens committed per step. Shows whether a drafter's extra
rows pay on this machine for this prompt (a row costs what the verify column says, not what the cached curve
says, when the host is noisy). Greedy, int4.

    python benchmarks/step_trace.py --prompt 5 [--turn 1] [--reps 2] [--tokens 256]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, required=True, help="index into the 80 MT-Bench questions")
    ap.add_argument(
        "--turn", type=int, choices=(1, 2), default=1, help="2: second turn, plain's first answer in context"
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    q = json.loads(DATA.read_text().splitlines()[args.prompt])
    llm = treedraft.load(weights="int4")
    prompt = q["turns"][0] if args.turn == 1 else second_turn(llm, q, args.tokens)[1]
    for rep in range(args.reps):
        for name, drafter in (("plain", None), ("default", "hybrid-suffix"), ("lookup", "prompt-lookup")):
            r = llm.generate(prompt, drafter=drafter, max_new_tokens=args.tokens)
            steps, total = r.stats.steps, r.stats.t_decode
            print(
                f"{name:8s} rep {rep}: {r.stats.new_tokens} tokens, {len(steps)} steps, {total * 1e3:.0f} ms "
                f"({total / max(1, len(steps)) * 1e3:.2f} ms / step)"
            )
            by: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
            for s in steps:
                b = by[s.tree_size]
                b[0] += 1
                b[1] += s.t_draft
                b[2] += s.t_verify
                b[3] += s.t_rest
                b[4] += s.accepted + 1
            if drafter is None:
                continue
            for k in sorted(by):
                n, td, tv, tr, tok = by[k]
                print(
                    f"   {k:3d} rows: {int(n):4d} steps, draft {td / n * 1e3:.2f} verify {tv / n * 1e3:.2f} "
                    f"rest {tr / n * 1e3:.2f} ms / step, {tok / n:.2f} tokens / step"
                )


if __name__ == "__main__":
    main()

"""Drafters on MT-Bench second turns side by side in one process, for any weight format.

Each question's first turn is answered by plain decoding; then the conversation (question, that answer, the
second question) is decoded greedily by plain decoding and by each method, the order rotated from question to
question. Every method drafts from its own copy of the drafter (one LLM's drafters share its in-memory suffix
index, and the second to run a question would otherwise draft the first one's output of it). Prints running
tok/s, then each method's speed over plain's and how many outputs equal plain's.

    python benchmarks/turn2_methods.py --weights fp32 --methods hybrid-suffix,hybrid-eagle [--prompts 10] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--methods", default="hybrid-suffix,hybrid-eagle")
    ap.add_argument("--prompts", type=int, default=10, help="every (80 / N)-th of the 80 questions")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    lines = DATA.read_text().splitlines()
    llm = treedraft.load(drafter=None, weights=args.weights)
    methods = [("plain", None)] + [(n, fresh_copy(llm.get_drafter(n))) for n in args.methods.split(",")]
    tot = {name: [0, 0.0] for name, _ in methods}
    equal = 0
    for j, i in enumerate(range(0, len(lines), max(1, len(lines) // args.prompts))):
        _, conv = second_turn(llm, json.loads(lines[i]), args.tokens)
        outs = {}
        for name, d in methods[j % len(methods) :] + methods[: j % len(methods)]:
            r = llm.generate(conv, drafter=d, max_new_tokens=args.tokens)
            tot[name][0] += r.stats.new_tokens
            tot[name][1] += r.stats.t_decode
            outs[name] = r.token_ids
        equal += all(o == outs["plain"] for o in outs.values())
        print(f"question {i}: " + ", ".join(f"{k} {v[0] / v[1]:.1f}" for k, v in tot.items()) + " tok/s", flush=True)
    plain = tot["plain"][0] / tot["plain"][1]
    print(
        f"\n{args.weights}, {j + 1} second turns x {args.tokens}: "
        + ", ".join(f"{k} {v[0] / v[1] / plain:.2f}x" for k, v in tot.items())
        + f"; outputs = plain {equal}/{j + 1}"
    )


if __name__ == "__main__":
    main()

"""Speculative decoding under repetition / presence / frequency penalties: speedup over plain and mean accepted
length per setting, outputs checked against plain (greedy). Plain and speculative alternate per prompt in one
process, so host noise hits both alike.

    python benchmarks/penalties_ab.py --prompts 10 --tokens 128
    python benchmarks/penalties_ab.py --prompts 6 --drafter medusa [--no-draft-penalties]

``--no-draft-penalties`` leaves the Medusa heads' candidates unadjusted (as before session 24's
``penalize_draft_``), to measure what adjusting them is worth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import fresh_copy

SETTINGS = [
    {},
    {"repetition_penalty": 1.1},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.5},
    {"presence_penalty": 0.5},
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--no-draft-penalties", action="store_true")
    ap.add_argument("--only", default=None, help="one setting, e.g. repetition_penalty=1.3")
    a = ap.parse_args()
    if a.no_draft_penalties:
        import treedraft.drafters.medusa as medusa

        medusa.penalize_draft_ = lambda *args, **kw: None
    qs = [json.loads(line)["turns"][0] for line in open(a.data)][: a.prompts]
    llm = treedraft.load()
    llm.generate(qs[0], max_new_tokens=8)  # warm-up
    settings = SETTINGS
    if a.only:
        key, value = a.only.split("=")
        settings = [{key: float(value)}]
    for kw in settings:
        t_plain = t_spec = 0.0
        acc, first, same = [], [], 0
        for q in qs:
            msgs = [{"role": "user", "content": q}]
            t0 = time.perf_counter()
            plain = llm.generate(msgs, max_new_tokens=a.tokens, drafter=None, **kw)
            t1 = time.perf_counter()
            # a fresh copy each run: the suffix member's index must not hold earlier runs' answers to this prompt
            drafter = fresh_copy(llm.get_drafter(a.drafter))
            spec = llm.generate(msgs, max_new_tokens=a.tokens, drafter=drafter, **kw)
            t2 = time.perf_counter()
            t_plain += t1 - t0
            t_spec += t2 - t1
            acc.append(spec.stats.mean_accepted_length)
            first += spec.stats.acceptance_per_depth()[:1]
            same += plain.token_ids == spec.token_ids
        name = ", ".join(f"{k} {v}" for k, v in kw.items()) or "no penalties"
        print(
            f"{name:28s} speedup {t_plain / t_spec:.2f}x  mean accepted {sum(acc) / len(acc):.2f}  "
            f"depth-1 acceptance {sum(first) / max(1, len(first)):.3f}  = plain {same}/{len(qs)}",
            flush=True,
        )


if __name__ == "__main__":
    main()

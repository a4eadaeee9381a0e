"""Drafting backoff (scheduler.BACKOFF_*) on and off, side by side: ms per token of plain decoding, the default drafter
with the backoff, and without it (BACKOFF_AFTER set out of reach), alternating per prompt in one process; outputs
checked against plain.

    python benchmarks/backoff_ab.py --prompts 10 --tokens 128 [--repetition-penalty 1.3] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import treedraft
from treedraft import scheduler
from treedraft.drafters.hybrid import fresh_copy as fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.data)][a.skip : a.skip + a.prompts]
    llm = treedraft.load()
    kw = dict(max_new_tokens=a.tokens, repetition_penalty=a.repetition_penalty, temperature=a.temperature, seed=1)
    llm.generate(qs[0], max_new_tokens=8)  # warm-up
    on_after = scheduler.BACKOFF_AFTER
    t = {"plain": 0.0, "backoff": 0.0, "no backoff": 0.0}
    n, same, steps = 0, 0, {"backoff": 0, "no backoff": 0}
    for q in qs:
        msgs = [{"role": "user", "content": q}]
        t0 = time.perf_counter()
        plain = llm.generate(msgs, drafter=None, **kw)
        t["plain"] += time.perf_counter() - t0
        for name, after in (("backoff", on_after), ("no backoff", 10**9)):
            scheduler.BACKOFF_AFTER = after
            t0 = time.perf_counter()
            r = llm.generate(msgs, drafter=fresh(llm.engine.drafter), **kw)  # no index of earlier runs
            t[name] += time.perf_counter() - t0
            same += r.token_ids == plain.token_ids
            steps[name] += sum(s.tree_size > 1 for s in r.stats.steps)
        scheduler.BACKOFF_AFTER = on_after
        n += len(plain.token_ids)
    print(
        f"repetition {a.repetition_penalty} T {a.temperature}: plain {t['plain'] / n * 1e3:.2f} ms/token, "
        f"backoff {t['plain'] / t['backoff']:.3f}x ({steps['backoff']} drafted steps), "
        f"no backoff {t['plain'] / t['no backoff']:.3f}x ({steps['no backoff']}); = plain {same}/{2 * len(qs)}"
    )


if __name__ == "__main__":
    main()

"""JSON mode with sampling (temperature 0.7, top-p 0.9, seeded per prompt): plain and the default drafter (a fresh
copy per run), in JSON mode and in free text, on MT-Bench first turns 41-50 asking for a JSON object; seeded
speculative output must equal plain.

    python benchmarks/json_mode_sampled.py [--prompts 10 --skip 40 --tokens 192]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import fresh_copy

ASK = "\n\nAnswer with a JSON object."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--skip", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.data)][a.skip : a.skip + a.prompts]
    llm = treedraft.load()
    llm.generate("hi", max_new_tokens=4, response_format="json_object")  # warm-up, builds the automaton
    runs = [(fmt, spec) for fmt in ("json_object", None) for spec in (False, True)]
    tokens = {k: 0 for k in runs}
    secs = {k: 0.0 for k in runs}
    outs: dict = {k: [] for k in runs}
    for i, q in enumerate(qs):
        msgs = [{"role": "user", "content": q + ASK}]
        for fmt, spec in runs:
            drafter = fresh_copy(llm.get_drafter("default")) if spec else None
            kw = dict(temperature=0.7, top_p=0.9, seed=i, response_format=fmt)
            r = llm.generate(msgs, max_new_tokens=a.tokens, drafter=drafter, **kw)
            tokens[fmt, spec] += r.stats.new_tokens
            secs[fmt, spec] += r.stats.t_decode
            outs[fmt, spec].append(r.token_ids)
    rate = {k: tokens[k] / secs[k] for k in runs}
    for (fmt, spec), v in rate.items():
        print(f"{fmt or 'free text':12s} {'default' if spec else 'plain':8s} {v:6.1f} tok/s")
    same = sum(x == y for x, y in zip(outs["json_object", False], outs["json_object", True]))
    print(f"JSON mode: {rate['json_object', True] / rate['json_object', False]:.3f}x plain, = plain {same}/{len(qs)}")
    print(f"free text: {rate[None, True] / rate[None, False]:.3f}x plain")


if __name__ == "__main__":
    main()

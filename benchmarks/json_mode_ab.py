"""JSON mode (``response_format`` json_object) side by side with free text: decode speed of plain and speculative
(the default drafter, a fresh copy per run) in both, the constraint's cost per plain token, outputs checked
against plain, and how many answers close their object. The four runs of a prompt go in a rotating order in one
process, so host noise hits them alike.

    python benchmarks/json_mode_ab.py --prompts 20 --tokens 256

Prompts: MT-Bench first turns with "Answer with a JSON object." appended (OpenAI's JSON mode also wants the
request to say so).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import fresh_copy

ASK = "\n\nAnswer with a JSON object."
RUNS = ("free-plain", "json-plain", "json-default", "free-default")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--skip", type=int, default=0, help="start at this MT-Bench question")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    ap.add_argument("--out", default=None, help="write the per-prompt records here (JSON lines)")
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.data)][a.skip : a.skip + a.prompts]
    llm = treedraft.load()
    llm.generate("Say hi.", max_new_tokens=8, response_format="json_object")  # warm-up, builds the automaton
    tok = {k: 0 for k in RUNS}
    sec = {k: 0.0 for k in RUNS}
    acc = {k: [] for k in RUNS}
    same = closed = parsed = 0
    out = open(a.out, "w") if a.out else None
    for i, q in enumerate(qs):
        msgs = [{"role": "user", "content": q + ASK}]
        res = {}
        for k in RUNS[i % 4 :] + RUNS[: i % 4]:
            drafter = None if k.endswith("plain") else fresh_copy(llm.get_drafter("default"))
            fmt = "json_object" if k.startswith("json") else None
            r = llm.generate(msgs, max_new_tokens=a.tokens, drafter=drafter, response_format=fmt)
            res[k] = r
            tok[k] += r.stats.new_tokens
            sec[k] += r.stats.t_decode
            acc[k].append(r.stats.mean_accepted_length)
        same += res["json-plain"].token_ids == res["json-default"].token_ids
        if res["json-plain"].finish_reason == "stop":
            closed += 1
            try:
                parsed += isinstance(json.loads(res["json-plain"].text), dict)
            except ValueError:
                pass
        if out is not None:
            rec = {"q": i + a.skip, **{k: [r.stats.new_tokens, r.stats.t_decode] for k, r in res.items()}}
            out.write(json.dumps(rec | {"json_text": res["json-plain"].text}) + "\n")
            out.flush()
        print(f"prompt {i + a.skip}: " + "  ".join(f"{k} {res[k].stats.tokens_per_s:.1f}" for k in RUNS), flush=True)
    rate = {k: tok[k] / sec[k] for k in RUNS}
    print(f"\n{platform.processor() or platform.machine()}; {len(qs)} prompts x {a.tokens} tokens, greedy")
    for k in RUNS:
        print(f"{k:13s} {rate[k]:7.1f} tok/s  mean accepted {sum(acc[k]) / len(acc[k]):.2f}")
    print(f"speedup, JSON mode: {rate['json-default'] / rate['json-plain']:.3f}x plain")
    print(f"speedup, free text: {rate['free-default'] / rate['free-plain']:.3f}x plain")
    print(f"plain ms per token: JSON {1e3 / rate['json-plain']:.2f}, free {1e3 / rate['free-plain']:.2f}")
    print(f"JSON speculative = plain {same}/{len(qs)}; objects closed {closed}/{len(qs)}, parsed {parsed}")


if __name__ == "__main__":
    main()

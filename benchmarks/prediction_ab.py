"""Predicted outputs (OpenAI's ``prediction``) side by side: plain decoding, the default drafter without a
prediction, and the default drafter with three kinds of prediction of the answer, none of which is in the prompt:

- ``exact``: the answer itself (a retry, a cached answer, a document sent back unchanged);
- ``edited``: the answer with every 5th line dropped and every 7th word changed (an edit the caller cannot
  predict in full);
- ``sampled``: the model's own answer to the same prompt at temperature 0.7 (another version of the text).

Greedy, so every run's output must equal plain's (checked). Each prompt's five runs go in a rotating order in one
process and each speculative run uses a fresh copy of the default drafter (nothing learned from earlier requests),
so the ratios are side by side on a shared host.

    python benchmarks/prediction_ab.py --prompts 10 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import fresh_copy

RUNS = ("plain", "default", "exact", "edited", "sampled")


def edited(text: str) -> str:
    """Every 5th line dropped, every 7th remaining word replaced."""
    lines = [ln for i, ln in enumerate(text.split("\n")) if i % 5 != 4]
    out = []
    for ln in lines:
        words = ln.split(" ")
        out.append(" ".join("thing" if i % 7 == 6 and w else w for i, w in enumerate(words)))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--skip", type=int, default=0, help="start at this MT-Bench question")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    ap.add_argument("--out", default=None, help="write the per-prompt records here (JSON lines)")
    a = ap.parse_args()
    qs = [json.loads(line)["turns"][0] for line in open(a.data)][a.skip : a.skip + a.prompts]
    llm = treedraft.load(weights=a.weights)
    llm.generate("Say hi.", max_new_tokens=8)  # warm-up
    tok = {k: 0 for k in RUNS}
    sec = {k: 0.0 for k in RUNS}
    acc: dict[str, list[float]] = {k: [] for k in RUNS}
    same = {k: 0 for k in RUNS}
    out = open(a.out, "w") if a.out else None
    for i, q in enumerate(qs):
        msgs = [{"role": "user", "content": q}]
        answer = llm.generate(msgs, max_new_tokens=a.tokens, drafter=None)
        sampled = llm.generate(msgs, max_new_tokens=a.tokens, drafter=None, temperature=0.7, seed=1000 + i)
        preds = {"exact": answer.text, "edited": edited(answer.text), "sampled": sampled.text}
        res = {}
        for k in RUNS[i % len(RUNS) :] + RUNS[: i % len(RUNS)]:
            drafter = None if k == "plain" else fresh_copy(llm.get_drafter("default"))
            r = llm.generate(msgs, max_new_tokens=a.tokens, drafter=drafter, prediction=preds.get(k))
            res[k] = r
            tok[k] += r.stats.new_tokens
            sec[k] += r.stats.t_decode
            acc[k].append(r.stats.mean_accepted_length)
            same[k] += r.token_ids == answer.token_ids
        if out is not None:
            rec = {"q": i + a.skip, **{k: [r.stats.new_tokens, r.stats.t_decode] for k, r in res.items()}}
            out.write(json.dumps(rec) + "\n")
            out.flush()
        print(f"prompt {i + a.skip}: " + "  ".join(f"{k} {res[k].stats.tokens_per_s:.1f}" for k in RUNS), flush=True)
    rate = {k: tok[k] / sec[k] for k in RUNS}
    print(f"\n{platform.processor() or platform.machine()}; {len(qs)} prompts x {a.tokens} tokens, greedy")
    print("| run | tok/s | x plain | x default | mean accepted | = plain |")
    print("|---|---|---|---|---|---|")
    for k in RUNS:
        print(
            f"| {k} | {rate[k]:.1f} | {rate[k] / rate['plain']:.2f} | {rate[k] / rate['default']:.2f} | "
            f"{sum(acc[k]) / len(acc[k]):.2f} | {same[k]}/{len(qs)} |"
        )


if __name__ == "__main__":
    main()

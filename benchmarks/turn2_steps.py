"""Where a second turn's decoding time goes, per kind of step: drafted by a model, or cheap (a suffix chain alone).

MT-Bench second turns (plain's greedy first answer in the context, as benchmarks/turn2_ceiling.py builds them),
plain and each ``--methods`` drafter side by side in one process, every output checked equal to plain's. Per method:
tok/s, x plain, steps, tokens per step, verified rows per step and ms per step of drafting and verifying; its steps
split by drafting time (``--cheap-ms``: below it, a step whose drafter ran no model forward, e.g. the suffix chain
leading alone in ``hybrid-draft``). Session 32 found with it that the int4 draft model's own prompt prefill and
catch-up were half of ``hybrid-draft``'s drafting time on second turns (fixed by copying the target's keys and
values, ``DraftModelDrafter.share_kv``).

    python benchmarks/turn2_steps.py [--prompts 4] [--weights fp32] [--methods hybrid-draft,hybrid-suffix]
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="hybrid-draft,hybrid-suffix")
    ap.add_argument("--cheap-ms", type=float, default=2.5, help="steps drafting less than this are 'cheap'")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = treedraft.load(drafter=None, weights=a.weights)
    path = find_shared_data(MT_BENCH_FILE)
    qs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()][a.skip : a.skip + a.prompts]
    drafters = {m: llm.get_drafter(m) for m in a.methods.split(",")}
    for d in drafters.values():  # warm-up (and the per-machine measurements a first use makes)
        llm.generate("Hello", drafter=fresh_copy(d), max_new_tokens=8)
    agg: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for q in qs:
        ids = llm.encode_prompt(second_turn(llm, q, a.tokens)[1])
        cfg = llm.config(max_new_tokens=a.tokens)
        ref = llm.text.generate(ids, cfg, None)
        for m, d in [("plain", None), *drafters.items()]:
            r = ref if d is None else llm.text.generate(ids, cfg, fresh_copy(d))
            if list(r.token_ids) != list(ref.token_ids):
                raise SystemExit(f"{m}: output differs from plain's")
            for s in r.stats.steps:
                kind = "cheap" if s.t_draft * 1e3 < a.cheap_ms else "drafted"
                for k in (m,) if d is None else (m, f"{m}: {kind} steps"):
                    t = agg[k]
                    t["steps"] += 1
                    t["draft"] += s.t_draft
                    t["verify"] += s.t_verify
                    t["time"] += s.t_draft + s.t_verify + s.t_rest
                    t["rows"] += s.tree_size
                    t["tokens"] += s.accepted + 1
            agg[m]["decode"] += r.stats.t_decode
    base = agg["plain"]["tokens"] / agg["plain"]["decode"]
    print(f"{len(qs)} second turns x {a.tokens}, {a.weights}, {a.threads} threads; all outputs = plain")
    print(
        "| method | tok/s | x plain | steps | tokens | ms / token | tokens / step | rows / step | draft ms / step "
        "| verify ms / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m, t in agg.items():
        n = t["steps"]
        speed = f"{t['tokens'] / t['decode']:.1f} | {t['tokens'] / t['decode'] / base:.2f}" if t["decode"] else "- | -"
        print(
            f"| {m} | {speed} | {n:.0f} | {t['tokens']:.0f} | {1e3 * t['time'] / t['tokens']:.2f} | "
            f"{t['tokens'] / n:.2f} | {t['rows'] / n:.1f} | {1e3 * t['draft'] / n:.1f} | {1e3 * t['verify'] / n:.1f} |"
        )


if __name__ == "__main__":
    main()

"""Where each drafter's MT-Bench second-turn time goes, step by step (issue 13): steps whose drafting took under 1.5 ms
(no draft-model forward: for ``hybrid-draft`` a suffix chain led; Medusa heads or suffix lookups alone also land
here) against steps that drafted longer (a draft model's forwards), with their shares of the decode time and of the
tokens, rows, tokens a step and drafting / verify ms a step. Plain decoding and every method
run on each prompt in one process; every output must equal plain's.

    python benchmarks/turn2_split.py --weights fp32 --prompts 8 --methods hybrid-draft,hybrid [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data

LIGHT_BELOW = 0.0015  # seconds of drafting under which a step ran no draft-model forward (one takes ~4 ms here)


def summary(name: str, steps: list) -> str:
    """One line per kind of step: (tree size, accepted, t_draft, t_verify, t_rest) records."""
    total_t = sum(s[2] + s[3] + s[4] for s in steps)
    total_tok = sum(s[1] + 1 for s in steps)
    out = []
    for kind, group in (("drafting < 1.5 ms (no draft model)", [s for s in steps if s[2] < LIGHT_BELOW]),
                        ("drafting >= 1.5 ms (a draft model)", [s for s in steps if s[2] >= LIGHT_BELOW])):  # fmt: skip
        if not group:
            continue
        n = len(group)
        out.append(
            f"  {kind}: {n} steps, time share {sum(s[2] + s[3] + s[4] for s in group) / total_t:.2f}, tokens share "
            f"{sum(s[1] + 1 for s in group) / total_tok:.2f}, rows {sum(s[0] for s in group) / n:.1f}, tokens a step "
            f"{sum(s[1] + 1 for s in group) / n:.2f}, drafting {1000 * sum(s[2] for s in group) / n:.1f} ms, verify "
            f"{1000 * sum(s[3] for s in group) / n:.1f} ms"
        )
    return "\n".join([name, *out])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", default="hybrid-draft,hybrid")
    a = ap.parse_args()
    data = find_shared_data(MT_BENCH_FILE)
    if data is None:
        raise SystemExit(f"needs ../shared/data/{MT_BENCH_FILE} beside the checkout")
    llm = treedraft.load(drafter=None, weights=a.weights)
    qs = [json.loads(ln) for ln in Path(data).read_text().splitlines() if ln.strip()][: a.prompts]
    methods = a.methods.split(",")
    built = {m: llm.get_drafter(m) for m in methods}
    for d in built.values():  # warm-up (and the per-machine measurements a first use makes)
        llm.generate("Hello", drafter=fresh_copy(d), max_new_tokens=8)
    cfg = llm.config(max_new_tokens=a.tokens)
    tot = {m: [0, 0.0, []] for m in ["plain", *methods]}  # new tokens, decode seconds, step records
    for i, q in enumerate(qs):
        ids = llm.encode_prompt(second_turn(llm, q, a.tokens)[1])
        ref = llm.text.generate(ids, cfg, None)
        tot["plain"][0] += ref.stats.new_tokens
        tot["plain"][1] += ref.stats.t_decode
        for m in methods:
            r = llm.text.generate(ids, cfg, fresh_copy(built[m]))
            if list(r.token_ids) != list(ref.token_ids):
                raise SystemExit(f"{m} prompt {i}: output differs from plain's")
            tot[m][0] += r.stats.new_tokens
            tot[m][1] += r.stats.t_decode
            tot[m][2] += [(s.tree_size, s.accepted, s.t_draft, s.t_verify, s.t_rest) for s in r.stats.steps]
        print(f"prompt {i} done", flush=True)
    base = tot["plain"][0] / tot["plain"][1]
    print(f"\n{len(qs)} second turns x {a.tokens}, {a.weights}, greedy; all outputs = plain; plain {base:.1f} tok/s")
    for m in methods:
        n, sec, steps = tot[m]
        print(summary(f"{m}: {n / sec:.1f} tok/s = {n / sec / base:.3f}x plain, {n / max(1, len(steps)):.2f} a step",
                      steps))  # fmt: skip


if __name__ == "__main__":
    main()

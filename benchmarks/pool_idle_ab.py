"""The native pool's idle wait, A/B in one process: per MT-Bench prompt every (spin:yield setting, method) pair in a
rotated order, greedy, fresh drafters; prints tok/s per pair against the first setting's plain decoding and checks
that every setting gave the same outputs.

Settings are ``spin_us:yield_us`` (kernels.set_idle_wait): ``100:0`` = before session 43 (spin 100 us, then sleep),
``100:2000`` = the default since (then poll with sched_yield for 2 ms), ``2000:0`` = a pause-loop spin as long.

    python benchmarks/pool_idle_ab.py [--prompts 8] [--start 0] [--tokens 256] [--turn 1|2]
        [--spins 100:0,100:2000,2000:0] [--methods none,suffix,hybrid-suffix]
"""

from __future__ import annotations

import argparse
import collections
import json

import treedraft
from treedraft import kernels
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--start", type=int, default=0)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--spins", default="100:0,100:2000,2000:0")
ap.add_argument("--methods", default="none,suffix,hybrid-suffix")
ap.add_argument("--turn", type=int, default=1)
ap.add_argument("--weights", default="int4")
a = ap.parse_args()
llm = treedraft.load(weights=a.weights, threads=2)
spins = [tuple(int(x) for x in s.split(":")) for s in a.spins.split(",")]
methods = a.methods.split(",")
qs = [json.loads(l) for l in open(find_shared_data(MT_BENCH_FILE))][a.start : a.start + a.prompts]
tok = collections.Counter()
sec = collections.Counter()
outs = {}
combos = [(s, m) for s in spins for m in methods]
for i, q in enumerate(qs):
    if a.turn == 2:
        first = llm.generate(q["turns"][0], max_new_tokens=a.tokens, drafter="none").text
        msgs = [
            {"role": "user", "content": q["turns"][0]},
            {"role": "assistant", "content": first},
            {"role": "user", "content": q["turns"][1]},
        ]
    else:
        msgs = [{"role": "user", "content": q["turns"][0]}]
    k = i % len(combos)
    for s, m in combos[k:] + combos[:k]:
        kernels.set_idle_wait(spin_us=s[0], yield_us=s[1])
        d = fresh_copy(llm.get_drafter(m)) if m != "none" else "none"
        r = llm.generate(msgs, max_new_tokens=a.tokens, drafter=d)
        tok[s, m] += r.stats.new_tokens
        sec[s, m] += r.stats.t_decode
        outs.setdefault((i, m), set()).add(tuple(r.token_ids))
    print(i, flush=True, end=" ")
print()
base = tok[spins[0], "none"] / sec[spins[0], "none"]
print("spin:yield method tok/s x(first plain)")
for s, m in combos:
    rate = tok[s, m] / sec[s, m]
    print(f"{s[0]:>5}:{s[1]:<5} {m:<14} {rate:7.1f} {rate / base:5.3f}")
print("outputs identical across spins:", all(len(v) == 1 for v in outs.values()))

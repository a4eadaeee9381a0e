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

from turn2_ceiling import ab_prompts, add_ab_args  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft import kernels
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig

ap = argparse.ArgumentParser()
add_ab_args(ap, "none,suffix,hybrid-suffix", prompts=8, seeded=False)
ap.add_argument("--spins", default="100:0,100:2000,2000:0")
a = ap.parse_args()
llm = treedraft.load(weights=a.weights, threads=2)
spins = [tuple(int(x) for x in s.split(":")) for s in a.spins.split(",")]
methods = a.methods.split(",")
cfg = GenerationConfig(max_new_tokens=a.tokens)
tok = collections.Counter()
sec = collections.Counter()
outs = {}
combos = [(s, m) for s in spins for m in methods]
for i, ids in enumerate(ab_prompts(llm, a)):
    k = i % len(combos)
    for s, m in combos[k:] + combos[:k]:
        kernels.set_idle_wait(spin_us=s[0], yield_us=s[1])
        r = llm.engine.generate(ids, cfg, None if m == "none" else fresh_copy(llm.get_drafter(m)))
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

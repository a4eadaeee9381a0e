"""One decode step of the bundled model on the given weights: median latency and a per-op profile.

Usage: python benchmarks/profile_step.py [int4|int8|fp32]
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import treedraft

llm = treedraft.load(drafter=None, weights=sys.argv[1] if len(sys.argv) > 1 else "int4")
m = llm.model
ids = llm.encode_prompt("Write a short story about a robot who learns to paint.")
cache = m.new_cache(1024)
with torch.inference_mode():
    m.forward(torch.tensor([ids]), torch.arange(len(ids)), cache, 0)
    cache.keep(0, range(len(ids)))
    pos = len(ids)

    def step():
        global pos
        m.forward(torch.tensor([[42]]), torch.tensor([pos]), cache, pos)
        cache.keep(pos, [0])
        pos += 1

    for _ in range(5):
        step()
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    ts.sort()
    print("1-token step median ms", 1000 * ts[len(ts) // 2], "min", 1000 * ts[0])
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(10):
            step()
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))

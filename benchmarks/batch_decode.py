"""Aggregate decode speed of the batched loop, in process (no HTTP): k requests at once vs one at a time.

For each k, k MT-Bench prompts are decoded together by one Scheduler (the server's loop) and, side by
side in the same process, one after another; prints tokens/s of both, their ratio, the step count and the
mean forward rows. Also the forward latency curve of packed one-row segments (k requests x 1 row).

Usage: python benchmarks/batch_decode.py [--weights int4] [--tokens 64] [--batch 1,8] [--step-rows N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig
from treedraft.models.llama import Segment
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file
from treedraft.scheduler import Scheduler, measured_step_rows

ap = argparse.ArgumentParser()
ap.add_argument("--weights", default="int4")
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--batch", default="1,8")
ap.add_argument("--step-rows", type=int, default=None, help="default: measured (as the server does)")
ap.add_argument("--drafter", default="default")
a = ap.parse_args()

llm = treedraft.load(weights=a.weights)
eng = llm.engine
model = eng.model
data = find_shared_data(MT_BENCH_FILE) or "/work/shared/data/" + MT_BENCH_FILE
prompts = [p.text for p in read_prompt_file(data)]
rows = a.step_rows or measured_step_rows(model)
base_drafter = llm.get_drafter(a.drafter) if a.drafter not in ("none", "plain") else None
drafter = base_drafter
cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)
print(
    f"weights {a.weights}, drafter {getattr(drafter, 'name', None)}, step_rows {rows}, threads {torch.get_num_threads()}"
)


@torch.inference_mode()
def packed_latency(k: int, context: int = 200, reps: int = 5) -> float:
    """Median seconds of one forward_packed of k one-row segments on k caches of ``context`` tokens."""
    caches = []
    for i in range(k):
        c = model.new_cache(context + 2)
        ids = torch.randint(0, model.vocab_size, (context,), generator=torch.Generator().manual_seed(i))
        model.forward_packed(ids, torch.arange(context), [Segment(c, 0, context, None)], torch.tensor([context - 1]))
        c.keep(0, range(context))
        caches.append(c)
    toks = torch.zeros(k, dtype=torch.long)
    pos = torch.full((k,), context)
    ts = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        model.forward_packed(toks, pos, [Segment(c, context, 1, None) for c in caches])
        ts.append(time.perf_counter() - t)
    return sorted(ts[1:])[reps // 2]


def run(k: int, together: bool) -> tuple[float, int, int]:
    """(seconds, tokens, steps) decoding k prompts together (one scheduler) or one after another."""
    ps = [llm.encode_prompt([{"role": "user", "content": prompts[i % len(prompts)]}]) for i in range(k)]
    t, n, steps = time.perf_counter(), 0, 0
    groups = [ps] if together else [[p] for p in ps]
    # a fresh drafter (empty suffix index) per run: else the run that goes second drafts from the first's answers
    fresh = None if base_drafter is None else fresh_copy(base_drafter)
    for group in groups:
        sched = Scheduler(eng, step_rows=rows, prefill_chunk=256)
        for p in group:
            sched.add(p, cfg, fresh)
        while sched.active:
            for _r, new in sched.step():
                n += len(new)
            steps += 1
            for r in [r for r in sched.active if r.done]:
                sched.remove(r)
    return time.perf_counter() - t, n, steps


lat1 = packed_latency(1)
for k in [int(x) for x in a.batch.split(",")]:
    lk = packed_latency(k)
    run(1, True)  # warm-up
    tb, nb, sb = run(k, True)
    ts, ns, ss = run(k, False)
    out = {
        "k": k,
        "packed_1row_latency_ratio": round(lk / lat1, 2),
        "together_tok_s": round(nb / tb, 2),
        "one_by_one_tok_s": round(ns / ts, 2),
        "speedup": round((nb / tb) / (ns / ts), 2),
        "steps_together": sb,
        "steps_one_by_one": ss,
    }
    print(json.dumps(out))

"""The load test's levels in process, on ONE scheduler as a server runs them: modeled tok/s per level.

``treedraft loadtest`` against a fresh server sends a warm-up request, then each concurrency level over the
same prompts, all through one scheduler (one row budget, one prefix cache, one suffix index). This replays
that without HTTP and prices every step's rows on a fixed latency curve (``--curve``, default the quiet
Skylake Xeon's int4 curve), so the result does not move with the machine's load; the wall tok/s is printed too.

    PYTHONPATH=src python benchmarks/server_like_levels.py [--tokens 256] [--prompts 8] [--prefix-cache-mb 256]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import treedraft
from treedraft.budget import interpolate
from treedraft.engine import GenerationConfig, GenerationStats
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file
from treedraft.scheduler import Scheduler, measured_latency, measured_step_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prefix-cache-mb", type=int, default=256, help="0: off (what older code had)")
    ap.add_argument("--curve", default="1:10.8,2:11.9,4:19.1,8:29.3,16:51.8", help="rows:ms,... for modeled tok/s")
    a = ap.parse_args()
    curve = {int(k): float(v) / 1000 for k, v in (x.split(":") for x in a.curve.split(","))}
    llm = treedraft.load(weights="int4")
    model = llm.engine.model
    texts = [p.text for p in read_prompt_file(find_shared_data(MT_BENCH_FILE))][: a.prompts]
    prompts = [llm.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    kw = {"prefix_cache_bytes": a.prefix_cache_mb << 20} if a.prefix_cache_mb else {}  # (older code: no such arg)
    sched = Scheduler(
        llm.engine, measured_step_rows(model), 256, latency=measured_latency(model), native_prefill=True, **kw
    )
    drafter = llm.get_drafter("default")
    cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)

    def level(ps: list[list[int]], c: int) -> dict:
        queue, modeled, steps, tokens, accepted = list(range(len(ps))), 0.0, 0, 0, []
        t0 = time.perf_counter()
        with torch.inference_mode():
            while queue or sched.active:
                while queue and len(sched.active) < c:
                    sched.add(ps[queue.pop(0)], cfg, drafter.for_tenant(""), GenerationStats())
                sched.step()
                steps += 1
                modeled += interpolate(curve, sched.last_step.rows) if sched.last_step.rows else 0.0
                for r in [r for r in sched.active if r.done]:
                    sched.remove(r)
                    tokens += r.n_out
                    accepted += [s.accepted + 1 for s in r.stats.steps]
        return {
            "c": c,
            "modeled tok/s": round(tokens / modeled, 1),
            "wall tok/s": round(tokens / (time.perf_counter() - t0), 1),
            "steps": steps,
            "mean accepted": round(sum(accepted) / max(1, len(accepted)), 2),
        }

    level(prompts[:1], 1)  # the load test's warm-up request
    for c in (int(x) for x in a.concurrency.split(",")):
        print(json.dumps(level(prompts, c)), flush=True)


if __name__ == "__main__":
    main()

"""The batched loop in process (no HTTP), as the server builds it: tokens/s and where a step's time goes.

k MT-Bench prompts (distinct, a fresh drafter per run) decoded together by one Scheduler with the server's
settings (measured step rows and latency curve, native prefill, 256-row prefill chunks); per run: tokens/s,
steps, ms per step, of which the native forward (``fused.forward_segments``) and the rest (scheduling,
drafting, acceptance: Python), and tokens per step.

    python benchmarks/sched_overhead.py [--drafter default] [--batch 1,8] [--tokens 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import time

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig
from treedraft.models import fused
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file
from treedraft.scheduler import Scheduler, measured_latency, measured_step_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    llm = treedraft.load(weights=a.weights)
    eng, model = llm.engine, llm.engine.model
    prompts = [p.text for p in read_prompt_file(find_shared_data(MT_BENCH_FILE))]
    rows, latency = measured_step_rows(model), measured_latency(model)
    base = None if a.drafter == "none" else llm.get_drafter(a.drafter)
    cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)
    spent = {"forward": 0.0}
    native = fused.forward_segments

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return native(*args, **kw)
        finally:
            spent["forward"] += time.perf_counter() - t

    fused.forward_segments = timed
    try:
        off = 0
        for run in range(a.runs):
            for k in [int(x) for x in a.batch.split(",")]:
                drafter = None if base is None else fresh_copy(base)
                sched = Scheduler(eng, rows, 256, latency=latency, native_prefill=True)
                for i in range(k):
                    sched.add(
                        llm.encode_prompt([{"role": "user", "content": prompts[(off + i) % len(prompts)]}]),
                        cfg,
                        drafter,
                    )
                off += k
                spent["forward"] = 0.0
                n = steps = 0
                t = time.perf_counter()
                while sched.active:
                    n += sum(len(new) for _r, new in sched.step())
                    steps += 1
                    for r in [r for r in sched.active if r.done]:
                        sched.remove(r)
                dt = time.perf_counter() - t
                print(
                    f"run {run} k={k}: {n / dt:.1f} tok/s, {steps} steps, {dt / steps * 1e3:.2f} ms/step "
                    f"(forward {spent['forward'] / steps * 1e3:.2f}, rest {(dt - spent['forward']) / steps * 1e3:.2f}), "
                    f"{n / steps:.2f} tokens/step"
                )
    finally:
        fused.forward_segments = native


if __name__ == "__main__":
    main()

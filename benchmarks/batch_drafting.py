"""Does drafting pay in a full batch? The default drafter against no drafter, k requests decoded together in process.

k MT-Bench prompts (fresh per repetition pair, a fresh drafter per run) through one Scheduler with the server's
settings (measured latency curve and step rows, native prefill, 256-row prefill chunks); the two variants
alternate. Per variant: median tok/s, and per step: tokens, rows, steps that drafted, and ms in the forward,
drafting, planning and acceptance.

    python benchmarks/batch_drafting.py [--batch 8] [--reps 4] [--tokens 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter, defaultdict

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file
from treedraft.scheduler import Scheduler, measured_latency, measured_step_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--drafter", default="default")
    a = ap.parse_args()
    llm = treedraft.load(weights="int4")
    eng = llm.engine
    prompts = [p.text for p in read_prompt_file(find_shared_data(MT_BENCH_FILE))]
    rows, latency = measured_step_rows(eng.model), measured_latency(eng.model)
    base = llm.get_drafter(a.drafter)
    cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)

    def run(off: int, drafter) -> Counter:
        sched = Scheduler(eng, rows, 256, latency=latency, native_prefill=True)
        d = None if drafter is None else fresh_copy(drafter)
        for i in range(a.batch):
            sched.add(llm.encode_prompt([{"role": "user", "content": prompts[(off + i) % len(prompts)]}]), cfg, d)
        st: Counter = Counter()
        t0 = time.perf_counter()
        while sched.active:
            sched.step()
            ls = sched.last_step
            st["steps"] += 1
            st["rows"] += ls.rows
            st["tokens"] += ls.committed
            st["drafted"] += ls.rows > ls.requests and ls.prefill_rows == 0
            for k in ("t_forward", "t_draft", "t_plan", "t_commit"):
                st[k] += getattr(ls, k)
            for r in [r for r in sched.active if r.done]:
                sched.remove(r)
        st["wall"] = time.perf_counter() - t0
        return st

    runs: dict[str, list[Counter]] = defaultdict(list)
    for rep in range(a.reps):
        order = [(a.drafter, base), ("none", None)]
        for name, d in order if rep % 2 == 0 else order[::-1]:
            runs[name].append(run(a.batch * (rep // 2), d))
    print(f"{a.batch} requests x {a.tokens} tokens, {a.reps} runs per variant (alternating)")
    for name, rs in runs.items():
        tot = sum(rs, Counter())
        n = tot["steps"]
        tps = statistics.median(r["tokens"] / r["wall"] for r in rs)
        print(
            f"{name:>14}: median {tps:7.1f} tok/s; per step {tot['tokens'] / n:.2f} tokens, {tot['rows'] / n:.2f} rows, "
            f"drafted in {tot['drafted']} of {n} steps; ms forward {1e3 * tot['t_forward'] / n:.2f}, draft "
            f"{1e3 * tot['t_draft'] / n:.2f}, plan {1e3 * tot['t_plan'] / n:.2f}, accept {1e3 * tot['t_commit'] / n:.2f}"
        )


if __name__ == "__main__":
    main()

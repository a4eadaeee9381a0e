"""Prompt processing (prefill) speed: treedraft's own runtime against llama.cpp on the same GGUF, same prompts.

Time to first token is what a user waits on for every long prompt (a second turn, a pasted document). For each
prompt length the script cuts that many tokens out of concatenated ShareGPT prompts (each length its own text, so
nothing is reused from an earlier one), times treedraft's prefill (``Engine.decode`` up to its first token, which is
the prefill's) and llama.cpp's ``eval`` of the same ids in a torch-free child, best of ``--reps``, and prints
prompt tokens per second for both and their ratio.

    python benchmarks/prefill_vs_llama_cpp.py --lengths 64,256,1024,2048 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LLAMA = r"""
import json, sys, time
import llama_cpp
job = json.loads(sys.stdin.read())
m = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"], n_threads_batch=job["threads"],
                    n_batch=job["n_batch"], verbose=False)
out = []
for ids in job["ids"]:
    best = None
    for _ in range(job["reps"]):
        m.reset()
        t0 = time.perf_counter()
        m.eval(ids)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    out.append(best)
print(json.dumps(out))
"""


def texts(n: int) -> list[str]:
    """ShareGPT prompts in file order (the shared data set beside the checkout)."""
    path = Path(__file__).resolve().parents[2] / "shared" / "data" / "sharegpt_prompts.jsonl"
    with open(path) as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--lengths", default="64,256,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp's n_batch (its default is 512)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    a = ap.parse_args()
    import treedraft
    from treedraft.cli import apply_threads
    from treedraft.models.registry import resolve

    apply_threads(a.threads)
    llm = treedraft.load(a.model, weights=a.weights)
    tok = llm.tokenizer
    lengths = [int(x) for x in a.lengths.split(",")]
    pool = []
    for t in texts(3000):
        pool.extend(tok.encode(t))
        if len(pool) > (sum(lengths) + 64) * (a.reps + 1):
            break
    jobs, at = [], 0
    for n in lengths:
        jobs.append(pool[at : at + n])
        at += n
    cfg = llm.config(max_new_tokens=1)
    ours = []
    llm.engine.decode(jobs[0][:32], cfg, None).__next__()  # warm-up: first-use builds and measurements
    for k, ids in enumerate(jobs):
        best = None
        for r in range(a.reps):
            shift = pool[at + r * 7 + k : at + r * 7 + k + 1]  # a different first token per rep: no cache reuse
            run = shift + ids[1:]
            t0 = time.perf_counter()
            gen = llm.engine.decode(run, cfg, None)
            next(gen)
            dt = time.perf_counter() - t0
            gen.close()
            best = dt if best is None else min(best, dt)
        ours.append(best)
    theirs = [None] * len(jobs)
    if not a.no_llama_cpp:
        job = {
            "gguf": str(resolve(a.model)),
            "ids": jobs,
            "threads": a.threads,
            "reps": a.reps,
            "n_ctx": max(lengths) + 64,
            "n_batch": a.n_batch,
        }
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
        res = subprocess.run(
            [sys.executable, "-c", LLAMA], input=json.dumps(job), capture_output=True, text=True, env=env, check=True
        )
        theirs = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"model {a.model}, weights {a.weights}, {a.threads} threads, best of {a.reps}")
    print("| prompt tokens | treedraft ms | treedraft tok/s | llama.cpp ms | llama.cpp tok/s | treedraft / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for n, o, t in zip(lengths, ours, theirs):
        lc = f"{t * 1e3:.1f} | {n / t:.0f} | {t / o:.2f}x" if t else "- | - | -"
        print(f"| {n} | {o * 1e3:.1f} | {n / o:.0f} | {lc} |")


if __name__ == "__main__":
    main()

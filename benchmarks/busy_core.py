"""Generation time with one core kept busy by another process vs quiet, plain and default drafter.

Usage: python benchmarks/busy_core.py [--weights int4] [--tokens 64]
"""

import argparse
import subprocess
import sys
import time

import treedraft

ap = argparse.ArgumentParser()
ap.add_argument("--weights", default="int4")
ap.add_argument("--tokens", type=int, default=64)
a = ap.parse_args()
llm = treedraft.load(weights=a.weights)
prompt = "Explain in three sentences why the sky is blue."


def run(drafter: str | None) -> tuple[float, list[int]]:
    t = time.perf_counter()
    r = llm.generate(prompt, drafter=drafter, max_new_tokens=a.tokens)
    return time.perf_counter() - t, r.token_ids


for name, d in (("plain", None), ("default", "default")):
    quiet, ids = min(run(d) for _ in range(2))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # keeps one core busy
    try:
        busy, ids2 = min(run(d) for _ in range(2))
    finally:
        hog.kill()
    print(
        f"{name}: quiet {quiet:.2f} s, one core busy {busy:.2f} s, ratio {busy / quiet:.2f}, same output {ids == ids2}"
    )

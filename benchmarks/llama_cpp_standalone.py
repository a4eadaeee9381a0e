"""llama.cpp plain decoding in a process of its own (no torch loaded), to check the bench's in-process baseline.

`treedraft bench --methods ...,llama.cpp` runs llama-cpp-python inside the bench process, interleaved with
treedraft's methods. Threads left spinning by another runtime in the same process (torch's OpenMP pool,
treedraft's kernel pool) would slow llama.cpp's own thread barriers and understate the baseline. This script
encodes the same MT-Bench first turns with treedraft's chat template in a child process, then decodes them
with llama.cpp greedily in a fresh child that never imports torch, for each thread count, and prints tok/s.
Compare its figure with the bench's llama.cpp row of a run on the same quiet machine.

    python benchmarks/llama_cpp_standalone.py --prompts 5 --max-new 256 --threads 2,1
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

ENCODE = r"""
import json, sys
import treedraft
from treedraft.bench.harness import find_default_dataset, load_prompts, select_prompts
from treedraft.models.registry import resolve
llm = treedraft.load(weights="int4")
prompts = select_prompts(load_prompts(find_default_dataset()), int(sys.argv[1]))
print(json.dumps({"gguf": str(resolve("smollm2-135m-instruct")), "ids": [llm.encode_prompt(p.text) for p in prompts]}))
"""

DECODE = r"""
import json, sys, time
import llama_cpp
job = json.loads(sys.stdin.read())
m = llama_cpp.Llama(model_path=job["gguf"], n_ctx=4096, n_threads=job["threads"], verbose=False, logits_all=False)
eos = m.token_eos()
out = []
for k, ids in enumerate([job["ids"][0]] + job["ids"]):  # the first prompt once more as warm-up
    n, t0 = 0, time.perf_counter()
    for tok in m.generate(ids, reset=True, temp=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0):
        n += 1
        if tok == eos or n >= job["max_new"]:
            break
    if k:
        out.append([n, time.perf_counter() - t0])
print(json.dumps(out))
"""


def main() -> None:
    """Encode once, then decode in one torch-free child per thread count and print tok/s."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--threads", default="2,1", help="comma-separated llama.cpp thread counts")
    a = ap.parse_args()
    enc = subprocess.run(
        [sys.executable, "-c", ENCODE, str(a.prompts)], check=True, capture_output=True, text=True
    ).stdout
    job = json.loads(enc.strip().splitlines()[-1])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"cpu: {cpu} ({platform.machine()}); {len(job['ids'])} prompts x {a.max_new} tokens")
    for th in [int(x) for x in a.threads.split(",")]:
        res = subprocess.run(
            [sys.executable, "-c", DECODE],
            input=json.dumps({**job, "threads": th, "max_new": a.max_new}),
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        runs = json.loads(res.strip().splitlines()[-1])
        toks, secs = sum(n for n, _ in runs), sum(s for _, s in runs)
        per = sorted(n / s for n, s in runs)
        print(
            f"llama.cpp standalone, {th} thread(s): {toks / secs:.1f} tok/s (per prompt median {per[len(per) // 2]:.1f})"
        )


if __name__ == "__main__":
    main()

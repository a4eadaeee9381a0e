"""Suffix drafter on MT-Bench first turns: a cold pass, then the same prompts with the warmed index.

Side by side in one process, interleaved per prompt (each prompt runs every method back to back, so
load from other processes hits all methods alike): plain, prompt-lookup, suffix, the current default
(hybrid = Medusa heads + prompt lookup) and hybrid + suffix. Pass 1 starts every suffix store empty
and records each finished request; pass 2 repeats the prompts. Greedy, so every output must equal
plain's (checked).

    PYTHONPATH=src python benchmarks/suffix_mtbench.py --prompts 5 --max-new 128 \
        --out benchmarks/results/suffix_mtbench.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.engine import GenerationStats

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--no-hybrid", action="store_true", help="skip the Medusa-based methods")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    prompts = [json.loads(ln)["turns"][0] for ln in DATA.read_text().splitlines()[: a.prompts]]
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    llm = treedraft.load(drafter=None)
    suffix = SuffixDrafter(SuffixStore())
    methods: dict[str, object] = {"plain": None, "prompt-lookup": PromptLookupDrafter(), "suffix": suffix}
    recorders = [suffix]
    if not a.no_hybrid:
        medusa = llm._drafter("medusa")
        hs = SuffixDrafter(SuffixStore())
        methods["hybrid"] = HybridDrafter([medusa, PromptLookupDrafter()])
        methods["hybrid+suffix"] = HybridDrafter([medusa, PromptLookupDrafter(), hs])
        recorders.append(hs)
    # warm-up (kernels, caches), not recorded
    for d in methods.values():
        llm.generate("Hello", drafter=d, max_new_tokens=8)
    for r in recorders:
        r._cur = None
    import os

    lines = [
        f"# suffix drafter, MT-Bench first turns ({a.prompts} prompts x {a.max_new} tokens, greedy)",
        "",
        (
            f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: tok/s are only "
            "comparable within a pass (methods interleaved per prompt)"
        ),
        "",
        f"`{' '.join(__import__('sys').argv)}`  ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
    ]
    for p in range(1, a.passes + 1):
        tot = {k: [0, 0.0, 0, 0] for k in methods}  # new tokens, decode s, steps, committed
        same = {k: 0 for k in methods}
        for prompt in prompts:
            ids = llm.encode_prompt(prompt)
            ref = None
            for name, d in methods.items():
                st = GenerationStats()
                out = [
                    t for c in llm.stream(prompt, drafter=d, stats=st, max_new_tokens=a.max_new) for t in c.token_ids
                ]
                if name == "plain":
                    ref = out
                same[name] += out == ref
                t = tot[name]
                t[0] += st.new_tokens
                t[1] += st.t_decode
                t[2] += len(st.steps)
                t[3] += sum(s.accepted + 1 for s in st.steps)
            for r in recorders:
                r.finish(ids, ref)
            print(f"pass {p}: prompt {prompts.index(prompt) + 1}/{len(prompts)} done", flush=True)
        base = tot["plain"][0] / tot["plain"][1]
        pl = tot["prompt-lookup"][0] / tot["prompt-lookup"][1]
        lines += [
            f"## pass {p} ({'cold index' if p == 1 else 'index warmed by the earlier passes'})",
            "",
            "| method | mean accepted | tok/s | x plain | x prompt-lookup | output = plain |",
            "|---|---|---|---|---|---|",
        ]
        for name, (n, s, steps, committed) in tot.items():
            tps = n / s
            lines.append(
                f"| {name} | {committed / max(1, steps):.2f} | {tps:.1f} | {tps / base:.2f} | "
                f"{tps / pl:.2f} | {same[name]}/{len(prompts)} |"
            )
        lines.append("")
        print("\n".join(lines[-len(tot) - 4 :]), flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()

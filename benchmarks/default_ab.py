"""The default drafter against prompt lookup on recorded prompts, one process per code version (A/B of branches).

Reads a benchmarks/suffix_repeated.py records.jsonl (its turn1-cold and turn2 prompts, plain's first answers)
and times prompt lookup and hybrid-suffix on them, back to back per prompt: turn1 with a fresh suffix store,
turn2 with the store warmed by plain's first answers (as suffix_repeated does). Run it once per checkout,
alternating, in the same window; compare the hybrid-suffix / prompt-lookup ratios:

    for src in /work/main/src src /work/main/src src; do PYTHONPATH=$src python benchmarks/default_ab.py \\
        --records OUT/records.jsonl --prompts 10 --tag $src; done
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import treedraft
from treedraft.drafters import registry
from treedraft.drafters.hybrid import fresh_copy
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    recs = [json.loads(ln) for ln in a.records.read_text().splitlines()]
    plain = {(r["pass"], r["prompt"]): r for r in recs if r["method"] == "plain"}
    llm = treedraft.load(drafter=None, weights=a.weights)
    warm = SuffixStore()
    default = registry.build(
        "hybrid-suffix", llm.model, llm.tokenizer, registry.DrafterOptions(llm.model_name, llm.heads, suffix_store=warm)
    )
    member = next(d for d in default.drafters if isinstance(d, SuffixDrafter))
    for i in range(a.prompts):
        r = plain[("turn1-cold", i)]
        warm.add(member.record_tokens(r["prompt_ids"], r["output_ids"]))
    pl = PromptLookupDrafter()
    for d in (pl, fresh_copy(default)):  # warm-up
        llm.generate("Hello", drafter=d, max_new_tokens=8)
    tot: dict[tuple[str, str], list[float]] = {}
    for i in range(a.prompts):
        for pass_ in ("turn1-cold", "turn2"):
            r = plain[(pass_, i)]
            for name in ("prompt-lookup", "hybrid-suffix"):
                d = pl if name == "prompt-lookup" else fresh_copy(default) if pass_ == "turn1-cold" else default
                res = llm.text.generate(r["prompt_ids"], llm.config(max_new_tokens=a.max_new), d)
                if list(res.token_ids) != r["output_ids"]:
                    raise SystemExit(f"{name} prompt {i} {pass_}: output differs from plain's")
                t = tot.setdefault((pass_, name), [0.0, 0.0, 0.0])
                t[0] += res.stats.new_tokens
                t[1] += res.stats.t_decode
                t[2] += len(res.stats.steps)
    for pass_ in ("turn1-cold", "turn2"):
        pl_t, df_t = tot[(pass_, "prompt-lookup")], tot[(pass_, "hybrid-suffix")]
        print(
            f"{a.tag} {pass_}: prompt-lookup {pl_t[0] / pl_t[1]:.1f} tok/s, hybrid-suffix {df_t[0] / df_t[1]:.1f} "
            f"tok/s, default / lookup {(df_t[0] / df_t[1]) / (pl_t[0] / pl_t[1]):.3f}, mean accepted "
            f"{pl_t[0] / pl_t[2]:.2f} / {df_t[0] / df_t[2]:.2f}, load {os.getloadavg()[0]:.1f} "
            f"{time.strftime('%H:%M:%S')}",
            flush=True,
        )


if __name__ == "__main__":
    main()

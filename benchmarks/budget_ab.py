"""The batch row budget's constants A/B, in one process: each variant patches constants of ``treedraft.budget`` and
decodes the same MT-Bench first turns through the batched scheduler (benchmarks/batch_throughput.py's ``run_level``),
variants alternating per round; the variant named ``equal`` runs equal row shares instead of the budget.

    python benchmarks/budget_ab.py --weights fp32 --drafter default --concurrency 4 --rounds 4 \\
        --variants "base:;weak-prior:PRIOR_WEIGHT=0.5;equal:" [--tokens 128] [--prompts 8] [--warm]

``--warm``: every run of a variant draws on that variant's own suffix index, so rounds after the first repeat the
first (suffix chains lead); else each run has a fresh one. Session 40 measured the budget's draft rounds with it
(benchmarks/results/batch-s40-budget-rounds/summary.txt).
"""

from __future__ import annotations

import argparse
import json

from batch_throughput import run_level  # benchmarks/ is on sys.path when run as a script

import treedraft
import treedraft.budget as budget
from treedraft.budget import measured_latency, measured_step_rows
from treedraft.engine import GenerationConfig
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file


def parse_variants(spec: str) -> list[tuple[str, dict[str, float]]]:
    """'name:CONST=value,CONST=value;name2:' -> [(name, {CONST: value})]."""
    out = []
    for part in spec.split(";"):
        name, _, kv = part.partition(":")
        out.append((name, {k: float(v) for k, v in (x.split("=") for x in kv.split(",") if x)}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32")
    ap.add_argument("--drafter", default="default")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", required=True, help="'name:CONST=value,...;name2:...' ('equal': equal row shares)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--warm", action="store_true", help="each variant keeps one suffix index across its runs")
    a = ap.parse_args()
    llm = treedraft.load(weights=a.weights)
    data = find_shared_data(MT_BENCH_FILE) or "/work/shared/data/" + MT_BENCH_FILE
    texts = [p.text for p in read_prompt_file(data)][: a.prompts]
    prompts = [llm.encode_prompt([{"role": "user", "content": t}]) for t in texts]
    model = llm.engine.model
    lat, rows = measured_latency(model), measured_step_rows(model)
    drafter = llm.get_drafter(a.drafter) if a.drafter != "none" else None
    variants = parse_variants(a.variants)
    orig = {k: getattr(budget, k) for _, patch in variants for k in patch}
    cfg = GenerationConfig(max_new_tokens=a.tokens, ignore_eos=True)
    run_level(llm, prompts[:1], 1, GenerationConfig(max_new_tokens=8), drafter, rows, None, None, "warm-up", False)
    got: dict[str, list[float]] = {name: [] for name, _ in variants}
    for r in range(a.rounds):
        for name, patch in variants if r % 2 == 0 else variants[::-1]:
            for k, v in {**orig, **{k: type(orig[k])(v) for k, v in patch.items()}}.items():
                setattr(budget, k, v)
            tenant = name if a.warm else f"{name}-{r}"
            latency = None if name == "equal" else lat
            run = run_level(llm, prompts, a.concurrency, cfg, drafter, rows, latency, None, tenant, False, True)
            row = run.row()
            got[name].append(row["tok/s"])
            keys = ("tok/s", "mean accepted", "decode rows/step", "draft ms")
            print(name, r, json.dumps({k: row[k] for k in keys}), flush=True)
    for k, v in orig.items():
        setattr(budget, k, v)
    for name, values in got.items():
        print(f"{name}: {', '.join(f'{x:.1f}' for x in values)} tok/s, mean {sum(values) / len(values):.1f}")


if __name__ == "__main__":
    main()

"""The default drafter with a stale cached latency curve, unchecked vs checked (budget.CHECK_ENV), side by side.

A tune directory holding curves and trees cached under other conditions (``--stale DIR``: e.g. a copy of
``~/.cache/treedraft/tune`` taken after a test run shared the cores) is copied into two private caches that
share the real cache's converted weights, tokenizers and kernels. One model is loaded from each: "stale" with
the check off (what every process did before it existed), "checked" with it on (it measures again what no
longer matches). Both then answer the same MT-Bench first turns greedily, alternating which goes first, in one
process, with plain decoding beside them; tok/s (decode only), tokens per step, draft nodes per step, and whether the outputs are equal.

    python benchmarks/curve_check_ab.py --stale DIR [--prompts 6] [--tokens 128] [--drafter hybrid-suffix] [--turn 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def private_cache(root: Path, stale: Path, real: Path) -> Path:
    """root/ with the real cache's artefacts linked in and ``stale``'s files as its tune/ directory."""
    root.mkdir(parents=True)
    for sub in ("weights", "tokenizers", "kernels", "gguf"):
        if (real / sub).is_dir():
            (root / sub).symlink_to(real / sub)
    shutil.copytree(stale, root / "tune")
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stale", required=True, type=Path, help="a tune/ directory of stale cached measurements")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafter", default="hybrid-suffix")
    ap.add_argument(
        "--turn", type=int, choices=(1, 2), default=1, help="2: second turns, plain's first answer in context"
    )
    args = ap.parse_args()
    if not args.stale.is_dir():
        raise SystemExit(f"--stale {args.stale}: not a directory")
    real = Path(os.environ.get("TREEDRAFT_CACHE", Path.home() / ".cache" / "treedraft"))
    tmp = Path(tempfile.mkdtemp(prefix="curve-check-"))
    import treedraft

    llms = {}
    for name, check in (("stale", "0"), ("checked", "1")):
        os.environ["TREEDRAFT_CACHE"] = str(private_cache(tmp / name, args.stale, real))
        os.environ["TREEDRAFT_CURVE_CHECK"] = check
        llms[name] = treedraft.load(drafter=args.drafter, weights="int4")
    questions = []
    for line in DATA.read_text().splitlines()[: args.prompts]:
        q = json.loads(line)
        questions.append(q["turns"][0] if args.turn == 1 else second_turn(llms["checked"], q, args.tokens)[1])
    runs = {
        "plain": (llms["checked"], None),
        "stale": (llms["stale"], args.drafter),
        "checked": (llms["checked"], args.drafter),
    }
    rows = {n: {"tokens": 0, "s": 0.0, "steps": 0, "nodes": 0} for n in runs}
    equal = 0
    for i, q in enumerate(questions):
        order = list(runs)[i % 3 :] + list(runs)[: i % 3]
        out = {}
        for name in order:
            llm, drafter = runs[name]
            r = llm.generate(q, drafter=drafter, max_new_tokens=args.tokens, temperature=0.0)
            st = r.stats
            steps = st.steps
            rows[name]["tokens"] += st.new_tokens
            rows[name]["s"] += st.t_decode
            rows[name]["steps"] += len(steps)
            rows[name]["nodes"] += sum(max(0, s.tree_size - 1) for s in steps)
            out[name] = r.token_ids
        equal += out["stale"] == out["checked"] == out["plain"]
        print(f"prompt {i}: " + ", ".join(f"{n} {len(out[n])} tokens" for n in order), flush=True)
    which = "first turns" if args.turn == 1 else "second turns (plain's first answer in context)"
    print(f"\n{args.drafter}, {args.prompts} MT-Bench {which} x {args.tokens}, greedy, int4")
    print("| curve | tok/s (decode) | tokens / step | draft nodes / step |\n|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['tokens'] / r['s']:.1f} | {r['tokens'] / r['steps']:.2f} | {r['nodes'] / r['steps']:.2f} |"
        )
    p, a, b = (rows[n]["tokens"] / rows[n]["s"] for n in ("plain", "stale", "checked"))
    print(
        f"\nx plain: stale {a / p:.2f}x, checked {b / p:.2f}x; checked / stale {b / a:.2f}x; outputs = plain {equal}/{len(questions)}"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

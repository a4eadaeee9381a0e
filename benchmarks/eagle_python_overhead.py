"""The EAGLE drafter's Python time per propose (propose wall minus its native draft calls), and its trees.

Greedy generations of the first MT-Bench turns with ``--drafter`` (eagle or hybrid-eagle); the drafter's
``propose`` and its native draft step are timed by wrapping them, so "python" = everything a propose does
besides the draft forwards themselves (commit bookkeeping, top-k, tree search and sizing).

``--record FILE`` pins the tree sizing's inputs (a fixed latency curve and draft costs instead of this machine's
cached measurements, which are re-measured whenever the kernels change) and pickles every tree and output;
``--compare A B`` then says whether two such files (e.g. before and after a change) drafted the same trees.

    python benchmarks/eagle_python_overhead.py [--drafter eagle] [--prompts 6] [--tokens 128] [--heads DIR] [--record F]
    python benchmarks/eagle_python_overhead.py --compare before.pkl after.pkl
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import torch

import treedraft
from treedraft.engine import GenerationConfig, GenerationStats

DATA = Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"
PINNED_CURVE = {1: 3.0e-3, 2: 3.1e-3, 4: 3.4e-3, 8: 4.4e-3, 16: 7.3e-3, 32: 13e-3}  # seconds by rows
PINNED_COSTS = (0.45e-3, 0.3e-3)  # (commit + depth 1, each further depth)


def compare(a: str, b: str) -> None:
    """Print whether two --record files hold the same outputs and trees."""
    x, y = (pickle.loads(Path(f).read_bytes()) for f in (a, b))
    same = sum(p == q for p, q in zip(x["trees"], y["trees"]))
    print(
        f"outputs equal: {x['outputs'] == y['outputs']}; trees equal: {same} of {len(x['trees'])} / {len(y['trees'])}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--heads", default=None, help="EAGLE drafter directory (default: the shipped one)")
    ap.add_argument("--record", default=None, help="pin the sizing inputs and pickle every tree and output here")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"))
    a = ap.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    llm = treedraft.load(drafter=None, weights=a.weights)
    d = llm.get_drafter(a.drafter) if a.heads is None else llm.get_drafter(a.drafter, heads=a.heads)
    eag = next(m for m in (d, *getattr(d, "drafters", ())) if getattr(m, "name", "") == "eagle")
    if a.record:
        from treedraft.drafters.eagle_tree import LatencyCurve

        eag.curve, eag.draft_costs, eag.step_seconds = LatencyCurve(PINNED_CURVE), PINNED_COSTS, PINNED_COSTS[1]
    acc = {"native": 0.0, "propose": 0.0, "n": 0}
    trees: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    native, propose = eag.native, eag.propose

    def timed_native(*args):
        t = time.perf_counter()
        out = native(*args)
        acc["native"] += time.perf_counter() - t
        return out

    def timed_propose(ctx):
        t = time.perf_counter()
        tree = propose(ctx)
        acc["propose"] += time.perf_counter() - t
        acc["n"] += 1
        trees.append((tuple(tree.tokens), tuple(tree.parents)))
        return tree

    if native is not None:
        eag.native = timed_native
    eag.propose = timed_propose
    qs = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[: a.prompts + 1]]
    ids = [llm.encode_prompt(q) for q in qs]
    outputs, steps, toks = [], 0, 0

    def run(p: list[int], n: int) -> GenerationStats:
        st = GenerationStats()
        out: list[int] = []
        with torch.inference_mode():
            for new in llm.engine.decode(p, GenerationConfig(max_new_tokens=n, ignore_eos=True), d, st):
                out += new
        outputs.append(out)
        return st

    run(ids[0], 32)  # warm-up, not counted
    outputs.clear()
    trees.clear()
    acc.update(native=0.0, propose=0.0, n=0)
    t0 = time.perf_counter()
    for p in ids[1:]:
        st = run(p, a.tokens)
        steps, toks = steps + len(st.steps), toks + st.new_tokens
    wall = time.perf_counter() - t0
    n = max(1, acc["n"])
    print(
        json.dumps(
            {
                "drafter": a.drafter,
                "pinned_sizing": bool(a.record),
                "steps": steps,
                "tok_per_s": round(toks / wall, 1),
                "proposes": acc["n"],
                "propose_ms": round(1e3 * acc["propose"] / n, 3),
                "native_ms": round(1e3 * acc["native"] / n, 3),
                "python_ms": round(1e3 * (acc["propose"] - acc["native"]) / n, 3),
                "nodes_per_tree": round(sum(len(t[0]) for t in trees) / max(1, len(trees)), 2),
            }
        )
    )
    if a.record:
        Path(a.record).write_bytes(pickle.dumps({"trees": trees, "outputs": outputs}))


if __name__ == "__main__":
    main()

"""Per-step profile of the suffix member against prompt lookup on recorded greedy outputs (issue 13, sfx7).

Greedy outputs equal plain decoding's, so a model-free drafter's steps can be replayed exactly (as in
benchmarks/suffix_replay.py). Per policy: steps, committed tokens / step, verify rows / step, measured
draft ms / step (this process, real ``propose`` calls), and an estimated step time = curve(rows) + draft.
For the suffix drafter also: nodes and accepted nodes by depth, and calibrated node value vs the
empirical acceptance rate by value bucket (is the pricing right?).

    PYTHONPATH=src python benchmarks/suffix_profile.py \
        --records benchmarks/results/suffix_repeated-s6-20x256/records.jsonl --pass turn2 --curve cached
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_sizing import ACCEPT_PRIOR, AcceptanceModel, LatencyCurve
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext
from treedraft.tree import matched_depth


def accepted_nodes(tree: object, out: list[int]) -> set[int]:
    """Indexes of the tree nodes on the accepted path (root excluded)."""
    node, got = 0, set()
    kids: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(tree.parents):  # type: ignore[attr-defined]
        if p >= 0:
            kids[p].append(i)
    for t in out:
        nxt = next((c for c in kids[node] if tree.tokens[c] == t), None)  # type: ignore[attr-defined]
        if nxt is None:
            break
        got.add(nxt)
        node = nxt
    return got


def replay(make, runs, curve, stats: dict, warm: list | None = None, max_nodes: int = 64) -> dict:
    """Replay every run with one drafter per pass (the store shared across prompts, as in the bench), its store
    first warmed with the ``warm`` runs (e.g. the first turns: the model's own first answers)."""
    d = make()
    for r in warm or []:  # (a cold pass: no warm runs, and a fresh drafter per prompt below)
        fin = getattr(d, "finish", None)
        if callable(fin):
            fin(r["prompt_ids"], r["output_ids"])
    tot = defaultdict(float)
    for r in runs:
        prompt, out = r["prompt_ids"], r["output_ids"]
        toks = list(prompt) + out[:1]
        k = 1
        while k < len(out):
            ctx = DraftContext(toks, None, max_nodes, len(out) - k, len(prompt))
            t0 = time.perf_counter()
            if hasattr(d, "propose_valued"):
                tree, values = d.propose_valued(ctx)
            else:
                tree, values = d.propose(ctx), None
            dt = time.perf_counter() - t0
            a = matched_depth(tree, out[k:])
            if values is not None:
                hit = accepted_nodes(tree, out[k:])
                depth = [0] * len(tree)
                for i in range(1, len(tree)):
                    depth[i] = depth[tree.parents[i]] + 1
                    v = values[i - 1]
                    b = min(9, int(v * 10))
                    stats["val"][b][0] += 1
                    stats["val"][b][1] += i in hit
                    stats["val"][b][2] += v
                    stats["depth"][depth[i]][0] += 1
                    stats["depth"][depth[i]][1] += i in hit
            toks.extend(out[k : k + a + 1])
            k += a + 1
            tot["steps"] += 1
            tot["rows"] += len(tree)
            tot["draft"] += dt
            tot["verify"] += float(curve(len(tree)))
        tot["tokens"] += len(out) - 1
        fin = getattr(d, "finish", None)
        if callable(fin):
            fin(prompt, out)
        if warm is None:
            d = make()
    return tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--pass", dest="pass_", default="turn2")
    ap.add_argument("--curve", required=True, help="JSON file {rows: seconds} (e.g. the cached step-rows value)")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--warm", default="turn1-cold", help="pass whose plain outputs warm the store first ('' = none)")
    ap.add_argument("--max-nodes", type=int, default=64, help="the engine's tree budget per step (root included)")
    ap.add_argument("--repeats", type=int, default=1, help="replays per policy (draft time: the median)")
    ap.add_argument("--detail", action="store_true", help="value calibration and nodes by depth per policy")
    ap.add_argument("--prior1", type=float, help="h(1) of the acceptance prior (default: ACCEPT_PRIOR's)")
    a = ap.parse_args()
    recs = [json.loads(ln) for ln in a.records.read_text().splitlines()]
    runs = [r for r in recs if r["pass"] == a.pass_ and r["method"] == "plain"]
    warm = [r for r in recs if r["pass"] == a.warm and r["method"] == "plain"] if a.warm else []
    if a.limit:
        runs, warm = runs[: a.limit], warm[: a.limit]
    raw = json.loads(Path(a.curve).read_text())
    raw = raw.get("value", raw)
    pts = {int(k): float(v) for k, v in raw.items()}
    curve = LatencyCurve(pts)
    sized = {"latency": pts, "alpha": 4.0, "max_spec_tokens": 64, "max_depth": 64, "min_match": 1}
    pols = {
        "prompt-lookup": PromptLookupDrafter,
        "suffix, expand then cut, re-match each step (sfx6)": lambda: SuffixDrafter(
            SuffixStore(), priced=False, follow=False, **sized
        ),
        "suffix, priced, re-match each step": lambda: SuffixDrafter(SuffixStore(), follow=False, **sized),
        "suffix, priced expansion (default member)": lambda: SuffixDrafter(SuffixStore(), **sized),
    }
    if a.prior1 is not None:
        prior = ((1, a.prior1), *ACCEPT_PRIOR[1:])

        def with_prior() -> SuffixDrafter:
            d = SuffixDrafter(SuffixStore(), **sized)
            d.acceptance = AcceptanceModel(prior)
            return d

        pols[f"suffix, h(1) = {a.prior1}"] = with_prior
    print(f"{len(runs)} {a.pass_} outputs; curve ms { ({k: round(v * 1e3, 1) for k, v in pts.items()}) }")
    print("| policy | steps | tok/step | rows/step | rows/tok | draft ms/step | est verify ms/step | est x plain |")
    print("|---|---|---|---|---|---|---|---|")
    res: dict[str, list[dict]] = defaultdict(list)
    stats: dict[str, dict] = {}
    for _ in range(a.repeats):  # policies alternate; the draft time reported is each one's median over repeats
        for name, make in pols.items():
            stats[name] = {"val": defaultdict(lambda: [0, 0, 0.0]), "depth": defaultdict(lambda: [0, 0])}
            res[name].append(
                replay(make, runs, curve, stats[name], None if a.pass_ == "turn1-cold" else warm, a.max_nodes)
            )
    for name, ts in res.items():
        t = dict(ts[0])
        t["draft"] = statistics.median(x["draft"] for x in ts)
        st = t["steps"]
        x = t["tokens"] * float(curve(1)) / (t["verify"] + t["draft"])
        print(
            f"| {name} | {st:.0f} | {t['tokens'] / st:.2f} | {t['rows'] / st:.2f} | {t['rows'] / t['tokens']:.3f} | "
            f"{t['draft'] / st * 1e3:.2f} | {t['verify'] / st * 1e3:.2f} | {x:.3f} |"
        )
    for name, sv in stats.items():
        if sv["val"] and a.detail:
            print(f"{name}: value bucket: nodes, accepted rate, mean value")
            for b in sorted(sv["val"]):
                n, h, v = sv["val"][b]
                print(f"    {b / 10:.1f}-{(b + 1) / 10:.1f}: {n} {h / n:.3f} {v / n:.3f}")
            print("  depth: nodes, accepted")
            print("    " + ", ".join(f"{dd}:{n}/{h}" for dd, (n, h) in sorted(sv["depth"].items())[:24]))


if __name__ == "__main__":
    main()

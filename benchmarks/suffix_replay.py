"""Replay greedy outputs through model-free drafters: accepted tokens per step and per verify row (issue 13).

Greedy speculative decoding commits exactly plain decoding's tokens, so a drafter that needs no
hidden state (prompt lookup, suffix) can be scored without the model: at each step it proposes a tree
on prompt + output so far, the step accepts the tree's longest path along the recorded output, plus
the bonus token. Time per step is estimated from a latency curve (rows -> seconds), so sizing rules
can be compared without timing noise. Medusa needs the target's hidden state and is left out (the
same for every policy compared).

    PYTHONPATH=src python benchmarks/suffix_replay.py \
        --records benchmarks/results/suffix_repeated-10x128/records.jsonl --pass turn2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_sizing import LatencyCurve
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext
from treedraft.tree import matched_depth

# one fused int4 step of SmolLM2-135M at a 256-token cache, 1 thread, quiet Xeon Skylake-SP (tune cache), ms
QUIET_CURVE = {1: 10.8, 2: 11.9, 4: 19.1, 8: 29.3, 12: 41.5, 16: 51.8, 24: 70.0, 32: 90.9, 48: 139.6, 64: 208.3}
FLAT_CURVE = {1: 1.0, 8: 1.02, 16: 1.05, 32: 1.1, 64: 1.25}  # rows nearly free (a large accelerator)


def replay(drafter: object, prompt: list[int], out: list[int], curve: LatencyCurve, max_nodes: int = 64) -> dict:
    """Steps, committed tokens, verify rows and estimated seconds of one greedy generation."""
    toks = list(prompt) + out[:1]  # the prefill's token is the first root
    k, steps, rows, secs = 1, 0, 0, 0.0
    while k < len(out):
        ctx = DraftContext(toks, None, max_nodes, len(out) - k, len(prompt))
        tree = drafter.propose(ctx)  # type: ignore[attr-defined]
        a = matched_depth(tree, out[k:])
        toks.extend(out[k : k + a + 1])
        k += a + 1
        steps, rows, secs = steps + 1, rows + len(tree), secs + float(curve(len(tree)))
    fin = getattr(drafter, "finish", None)
    if callable(fin):
        fin(prompt, out)
    return {"steps": steps, "tokens": len(out) - 1, "rows": rows, "secs": secs}


def oracle(prompt: list[int], out: list[int], curve: LatencyCurve) -> dict:
    """The ceiling of sizing alone: each step drafts the true continuation as far as the longest-match chain
    (or prompt lookup) would have agreed, cut where tokens per second peak."""
    d = HybridDrafter(
        [
            PromptLookupDrafter(max_tokens=64),
            SuffixDrafter(SuffixStore(), alpha=100.0, max_spec_tokens=63, max_depth=64, min_prob=0.0),
        ]
    )
    best = [max(range(a + 1), key=lambda k: (k + 1) / float(curve(k + 1))) for a in range(len(out) + 1)]
    toks, k, steps, rows, secs = list(prompt) + out[:1], 1, 0, 0, 0.0
    while k < len(out):
        a = matched_depth(d.propose(DraftContext(toks, None, 64, len(out) - k, len(prompt))), out[k:])
        toks.extend(out[k : k + best[a] + 1])
        k, steps, rows = k + best[a] + 1, steps + 1, rows + best[a] + 1
        secs += float(curve(best[a] + 1))
    return {"steps": steps, "tokens": len(out) - 1, "rows": rows, "secs": secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=Path, required=True, help="records.jsonl of benchmarks/suffix_repeated.py")
    ap.add_argument("--pass", dest="pass_", default="turn2")
    ap.add_argument("--curve", help="'flat', or a JSON file {rows: seconds}; default: the quiet Xeon int4 curve")
    a = ap.parse_args()
    recs = [json.loads(ln) for ln in a.records.read_text().splitlines()]
    runs = [r for r in recs if r["pass"] == a.pass_ and r["method"] == "plain"]
    curve_pts = FLAT_CURVE if a.curve == "flat" else json.loads(Path(a.curve).read_text()) if a.curve else QUIET_CURVE
    curve = LatencyCurve({int(k): float(v) for k, v in curve_pts.items()})
    sized = {"latency": curve_pts, "alpha": 4.0, "max_spec_tokens": 64, "max_depth": 64}
    policies = {
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "prompt-lookup + suffix, alpha x match rule (before)": lambda: HybridDrafter(
            [PromptLookupDrafter(), SuffixDrafter(SuffixStore(), min_match=2)]
        ),
        "prompt-lookup + suffix, sized": lambda: HybridDrafter(
            [PromptLookupDrafter(), SuffixDrafter(SuffixStore(), min_match=2, **sized)]
        ),
        "suffix, sized (hybrid-suffix's member now)": lambda: SuffixDrafter(SuffixStore(), min_match=1, **sized),
    }
    print(f"{len(runs)} {a.pass_} outputs (greedy, = plain's); curve {curve_pts}")
    print("| policy | steps | committed / step | tok / verify row | est. x plain | per-prompt x plain (min/med/max) |")
    print("|---|---|---|---|---|---|")
    for name, make in [*policies.items(), ("oracle sizing (ceiling)", None)]:
        res = [
            replay(make(), r["prompt_ids"], r["output_ids"], curve)
            if make
            else oracle(r["prompt_ids"], r["output_ids"], curve)
            for r in runs
        ]
        st, tk, rw, sc = (sum(x[k] for x in res) for k in ("steps", "tokens", "rows", "secs"))
        per = sorted(x["tokens"] * float(curve(1)) / x["secs"] for x in res)
        print(
            f"| {name} | {st} | {tk / st:.2f} | {tk / rw:.2f} | {tk * float(curve(1)) / sc:.2f} | "
            f"{per[0]:.2f} / {statistics.median(per):.2f} / {per[-1]:.2f} |"
        )


if __name__ == "__main__":
    main()

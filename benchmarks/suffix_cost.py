"""Drafting cost per step of the model-free drafters, in thread CPU time, on recorded greedy outputs (issue 13).

Replays the plain (greedy) outputs of ``benchmarks/suffix_repeated.py`` records as the engine would see
them (prompt + output so far, the token list extended in place, a 64-node budget) through each drafter
and times every ``propose`` with ``time.thread_time`` (CPU time of this thread only: other processes'
load counts only through shared caches and, in a VM, stolen time). The store is warmed like the
benchmark's: before prompt i's passes, the first answers of prompts <= i are recorded; each replayed
request is recorded when it ends (``finish``).

``--baseline SRC`` also loads another copy of the code (the ``src`` folder of another checkout, e.g.
``git archive HEAD~3 src | tar -x -C /tmp/base``) and replays it interleaved with this one, prompt by
prompt, so both see the same load; every proposed tree is compared node for node (tokens and parents)
and the first difference is printed.

    PYTHONPATH=src python benchmarks/suffix_cost.py \
        --records benchmarks/results/suffix_repeated-s4-10x256/records.jsonl --passes turn2 \
        --baseline /tmp/base/src

``--profile`` prints a cProfile of the suffix member instead (one replay).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import importlib.util
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import treedraft
from treedraft.tree import matched_depth

# the quiet Xeon int4 curve of benchmarks/suffix_replay.py (ms by rows); only its shape matters here
QUIET_CURVE = {1: 10.8, 2: 11.9, 4: 19.1, 8: 29.3, 12: 41.5, 16: 51.8, 24: 70.0, 32: 90.9, 48: 139.6, 64: 208.3}
DRAFTERS = ("suffix member", "prompt-lookup", "hybrid-suffix (stub heads)", "hybrid (stub heads)")


def load_copy(src: Path, alias: str = "treedraft_baseline") -> ModuleType:
    """Import ``src/treedraft`` as package ``alias`` (the drafters use relative imports only)."""
    init = src / "treedraft" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"--baseline {src}: no treedraft/__init__.py there; pass a checkout's src folder")
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[alias] = mod
    spec.loader.exec_module(mod)
    return mod


class Code:
    """The drafter classes of one copy of the code."""

    def __init__(self, pkg: str) -> None:
        self.hybrid = importlib.import_module(f"{pkg}.drafters.hybrid").HybridDrafter
        self.lookup = importlib.import_module(f"{pkg}.drafters.prompt_lookup").PromptLookupDrafter
        self.suffix = importlib.import_module(f"{pkg}.drafters.suffix").SuffixDrafter
        self.store = importlib.import_module(f"{pkg}.drafters.suffix_store").SuffixStore
        self.tree = importlib.import_module(f"{pkg}.tree").TokenTree
        self.ctx = importlib.import_module(f"{pkg}.interfaces").DraftContext

    def member(self, store: Any) -> Any:
        """hybrid-suffix's suffix member as the registry builds it (latency-sized, min_match=1)."""
        return self.suffix(store, min_match=1, latency=QUIET_CURVE, alpha=4.0, max_spec_tokens=64, max_depth=64)

    def make(self, name: str, store: Any) -> Any:
        """Drafter ``name`` over ``store``; the Medusa member is a fixed 12-node tree (it needs the model)."""
        stub = FixedTree(self.tree)
        if name == "suffix member":
            return self.member(store)
        if name == "prompt-lookup":
            return self.lookup()
        if name == "hybrid-suffix (stub heads)":
            return self.hybrid([stub, self.member(store)], lead_extra=0)
        if name == "hybrid (stub heads)":
            return self.hybrid([stub, self.lookup()])
        raise SystemExit(f"unknown drafter {name!r}; choose from {DRAFTERS}")


class FixedTree:
    """A stand-in for the Medusa member: the same 12-node tree shape every step (tokens offset from the root)."""

    name = "medusa-stub"
    parents = (-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 8)

    def __init__(self, tree_cls: Any) -> None:
        self.tree_cls = tree_cls

    def propose(self, ctx: Any) -> Any:
        """A fixed-shape tree rooted at ctx.root."""
        root = int(ctx.root)
        return self.tree_cls(tuple(root if i == 0 else (root + 7 * i) % 49152 for i in range(12)), self.parents)


def replay(code: Code, drafter: Any, prompt: list[int], out: list[int], times: list[float], trees: list) -> None:
    """One greedy generation replayed: propose, accept along ``out``, extend; CPU seconds per propose appended."""
    toks = list(prompt) + out[:1]
    k = 1
    while k < len(out):
        ctx = code.ctx(toks, None, 64, len(out) - k, len(prompt))
        t0 = time.thread_time()
        tree = drafter.propose(ctx)
        times.append(time.thread_time() - t0)
        trees.append((tree.tokens, tree.parents))
        a = matched_depth(tree, out[k:])
        toks.extend(out[k : k + a + 1])
        k += a + 1
    fin = getattr(drafter, "finish", None)
    if callable(fin):
        fin(prompt, out)


def run(codes: list[Code], recs: list[dict], passes: list[str], name: str, reps: int) -> list[tuple[list, list]]:
    """(CPU seconds per propose, trees of the first rep) per copy of the code, replayed interleaved."""
    plain = {(r["pass"], r["prompt"]): r for r in recs if r["method"] == "plain"}
    prompts = sorted({p for _, p in plain})
    out: list[tuple[list, list]] = [([], []) for _ in codes]
    for rep in range(reps):
        state = []
        for c in codes:
            store = c.store()
            state.append((c.make(name, store), c.member(store)))
        for i in prompts:
            first = plain[("turn1-cold", i)]
            for c, (d, recorder), (times, trees) in zip(codes, state, out):
                recorder.finish(first["prompt_ids"], first["output_ids"])  # the first answer, recorded
                for p in passes:
                    r = plain.get((p, i))
                    if r is not None:
                        replay(c, d, r["prompt_ids"], r["output_ids"], times, [] if rep else trees)
    return out


def python_speed() -> float:
    """CPU ms of this thread for a 10^6-iteration Python loop: how fast the interpreter runs right now (load and
    stolen time in a VM slow it down too), to read the absolute numbers by."""
    t0, acc = time.thread_time(), 0
    for i in range(1_000_000):
        acc += i
    return (time.thread_time() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--passes", default="turn2", help="comma-separated passes to replay (turn2, turn1-repeat, ...)")
    ap.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma-separated subset of {list(DRAFTERS)}")
    ap.add_argument("--reps", type=int, default=3, help="replays per drafter (times pooled)")
    ap.add_argument("--baseline", type=Path, help="another checkout's src folder: timed side by side, trees compared")
    ap.add_argument("--profile", action="store_true", help="cProfile the suffix member (one replay)")
    a = ap.parse_args()
    recs = [json.loads(ln) for ln in a.records.read_text().splitlines()]
    passes = [p for p in a.passes.split(",") if p]
    names = [n for n in a.drafters.split(",") if n]
    codes = [Code("treedraft")]
    labels = [f"this ({Path(treedraft.__file__).parents[1]})"]
    if a.baseline:
        load_copy(a.baseline)
        codes.append(Code("treedraft_baseline"))
        labels.append(f"baseline ({a.baseline})")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        run(codes[:1], recs, passes, "suffix member", 1)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print(f"passes {passes}; CPU time of this thread per propose, ms; {a.reps} replays interleaved")
    print("| drafter | code | steps | mean | median | p90 | p99 | max |")
    print("|---|---|---|---|---|---|---|---|")
    means: dict[str, list[float]] = {}
    verdicts = []
    for name in names:
        res = run(codes, recs, passes, name, a.reps)
        for label, (times, trees) in zip(labels, res):
            ts = sorted(times)
            q = [ts[int(f * (len(ts) - 1))] * 1e3 for f in (0.5, 0.9, 0.99)]
            means.setdefault(name, []).append(statistics.fmean(ts) * 1e3)
            print(
                f"| {name} | {label} | {len(trees)} | {means[name][-1]:.3f} | {q[0]:.3f} | {q[1]:.3f} | {q[2]:.3f} | "
                f"{ts[-1] * 1e3:.3f} |"
            )
        if a.baseline:
            (_, new), (_, old) = res
            diff = next((i for i, (x, y) in enumerate(zip(new, old)) if x != y), None)
            if diff is None and len(new) == len(old):
                verdicts.append(f"{name}: {len(new)} trees identical; mean cost {means[name][0] / means[name][1]:.2f}x")
            else:
                at = diff if diff is not None else min(len(new), len(old))
                verdicts.append(
                    f"{name}: DIFFERENT at step {at} of {len(new)}/{len(old)}: "
                    f"{new[at] if at < len(new) else None} vs {old[at] if at < len(old) else None}"
                )
    for v in verdicts:
        print(v)
    print(f"reference: a 10^6-iteration Python loop took {python_speed():.0f} ms of thread CPU time")
    if any("DIFFERENT" in v for v in verdicts):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

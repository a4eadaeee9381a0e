"""Where the default drafter's step time goes against prompt lookup's (issue 13), side by side in one process.

For a few MT-Bench questions: the first turn with a cold index and the second turn (the model's own
first answer in the context, the store warmed with it), each run by plain decoding, prompt lookup and the
default drafter (hybrid-suffix) back to back. Per method: tok/s and x plain, mean committed tokens per
step, rows verified per step, verify / draft / other ms per step; for the default also the draft time of
each member, which member led the step, whose tree held the accepted path (Medusa, suffix, both), and
the verify time by row count measured in this run (the latency curve under the load of the moment).

    PYTHONPATH=src python benchmarks/default_vs_lookup.py --prompts 4 --max-new 128 --weights int4

``--drafter NAME`` times another registered drafter in the default's place (e.g. a variant under test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import treedraft
from treedraft.drafters import registry
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree, matched_depth

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "mt_bench_questions.jsonl"


@dataclasses.dataclass
class Timed:
    """Wraps one member drafter: the same trees, each call's seconds and tree kept for the step record."""

    inner: object
    log: list = dataclasses.field(default_factory=list)

    def __getattr__(self, k: str) -> object:
        return getattr(self.inner, k)

    def for_request(self) -> Timed:
        """The inner drafter's per-request twin, still timed into the same log."""
        fork = getattr(self.inner, "for_request", None)
        return dataclasses.replace(self, inner=fork() if callable(fork) else self.inner)

    def propose(self, ctx: DraftContext) -> TokenTree:
        """The member's tree (timed)."""
        t = time.perf_counter()
        tree = self.inner.propose(ctx)  # type: ignore[attr-defined]
        self.log.append((self.inner.name, time.perf_counter() - t, tree, None))  # type: ignore[attr-defined]
        return tree


@dataclasses.dataclass
class TimedScored(Timed):
    """:class:`Timed` for a member that scores its trees (``propose_scored``)."""

    def propose_scored(self, ctx: DraftContext) -> tuple[TokenTree, float]:
        """The member's tree and score (timed)."""
        t = time.perf_counter()
        tree, score = self.inner.propose_scored(ctx)  # type: ignore[attr-defined]
        self.log.append((self.inner.name, time.perf_counter() - t, tree, score))  # type: ignore[attr-defined]
        return tree, score


@dataclasses.dataclass
class TimedValued(TimedScored):
    """:class:`TimedScored` for a member that values its nodes (``propose_valued``)."""

    def propose_valued(self, ctx: DraftContext) -> tuple[TokenTree, list[float]]:
        """The member's tree and node values (timed)."""
        t = time.perf_counter()
        tree, values = self.inner.propose_valued(ctx)  # type: ignore[attr-defined]
        self.log.append((self.inner.name, time.perf_counter() - t, tree, sum(values)))  # type: ignore[attr-defined]
        return tree, values


@dataclasses.dataclass
class Steps:
    """Wraps the hybrid: a step marker (the context length) in the log before each propose."""

    inner: HybridDrafter
    log: list
    name: str = "steps"

    def propose(self, ctx: DraftContext) -> TokenTree:
        """The hybrid's tree."""
        self.log.append(len(ctx.tokens))
        return self.inner.propose(ctx)

    def for_request(self) -> Steps:
        """The hybrid's per-request twin, still logged."""
        return dataclasses.replace(self, inner=self.inner.for_request())

    def finish(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Forwarded."""
        self.inner.finish(prompt_ids, output_ids)


def instrument(d: HybridDrafter) -> tuple[Steps, list]:
    """The hybrid with members that log (name, seconds, tree, score) per call and a step marker per propose."""
    log: list = []

    def wrap(m: object) -> Timed:
        if callable(getattr(m, "propose_valued", None)):
            return TimedValued(m, log)
        return (TimedScored if callable(getattr(m, "propose_scored", None)) else Timed)(m, log)

    return Steps(dataclasses.replace(d, drafters=[wrap(m) for m in d.drafters]), log), log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--first", type=int, default=0, help="index of the first question")
    ap.add_argument("--pick", default="", help="comma-separated question indexes (instead of --first/--prompts)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--drafter", default="hybrid-suffix", help="comma-separated registry names to time")
    ap.add_argument("--passes", default="turn1-cold,turn2")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--json", type=Path, help="write the per-step records here")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    allq = [json.loads(ln) for ln in a.data.read_text().splitlines()]
    picked = [int(x) for x in a.pick.split(",")] if a.pick else list(range(a.first, a.first + a.prompts))
    qs = [allq[j] for j in picked]
    llm = treedraft.load(drafter=None, weights=a.weights)

    def ungated(target: object, tokenizer: object, options: registry.DrafterOptions) -> object:
        """The default as it was: the heads drafted whenever the suffix chain does not lead."""
        return dataclasses.replace(registry.build("hybrid-suffix", target, tokenizer, options), latency=None)

    registry.register("hybrid-suffix-ungated", ungated, "the default without paid heads", replace=True)

    opts = registry.DrafterOptions(llm.model_name, llm.heads)
    passes = a.passes.split(",")
    methods = ("plain", "prompt-lookup", *a.drafter.split(","))
    agg: dict[tuple[str, str], dict] = defaultdict(lambda: defaultdict(float))
    by_rows: dict[int, list[float]] = defaultdict(list)
    members: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    outs: dict[tuple[str, int], list[int]] = {}
    dump = []
    llm.generate("Hello", drafter=PromptLookupDrafter(), max_new_tokens=8)
    for i, q in enumerate(qs):
        answer1 = ""
        for pass_ in passes:
            msgs = [{"role": "user", "content": q["turns"][0]}]
            if pass_ == "turn2":
                msgs += [{"role": "assistant", "content": answer1}, {"role": "user", "content": q["turns"][1]}]
            ids = llm.encode_prompt(msgs)
            for m in methods:
                log: list = []
                if m == "plain":
                    d = None
                elif m == "prompt-lookup":
                    d = PromptLookupDrafter()
                else:
                    store = SuffixStore()
                    if pass_ == "turn2":  # a server would have recorded the first turn
                        ids1 = llm.encode_prompt(msgs[:1])
                        store.add(ids1[-32:] + outs[("turn1-cold", i)])
                    d = registry.build(m, llm.model, llm.tokenizer, dataclasses.replace(opts, suffix_store=store))
                    if isinstance(d, HybridDrafter):
                        d, log = instrument(d)
                res = llm.text.generate(ids, llm.config(max_new_tokens=a.max_new), d)
                out = list(res.token_ids)
                if m == "plain":
                    outs[(pass_, i)] = out
                    if pass_ == "turn1-cold":
                        answer1 = res.text
                st = res.stats
                g = agg[(pass_, m)]
                g["tokens"] += st.new_tokens
                g["t"] += st.t_decode
                g["steps"] += len(st.steps)
                g["rows"] += sum(s.tree_size for s in st.steps)
                g["draft"] += sum(s.t_draft for s in st.steps)
                g["verify"] += sum(s.t_verify for s in st.steps)
                g["rest"] += sum(s.t_rest for s in st.steps)
                g["same"] += out == outs[(pass_, i)]
                g["n"] += 1
                for s in st.steps:
                    by_rows[s.tree_size].append(s.t_verify)
                if log:  # per step: each member's calls (a member not run has none), whose tree held the path
                    full = ids + out
                    steps = []
                    for e in log:
                        if isinstance(e, int):
                            steps.append((e, []))
                        elif steps:
                            steps[-1][1].append(e)
                    for at, calls in steps:
                        future = full[at:]
                        rec = {"pass": pass_, "prompt": i, "method": m}
                        depths = {}
                        for name, secs, tree, score in calls:
                            mm = members[(pass_, m, name)]
                            mm["calls"] += 1
                            mm["secs"] += secs
                            mm["nodes"] += len(tree) - 1
                            depths[name] = matched_depth(tree, future)
                            mm["accepted"] += depths[name]
                            rec[name] = (len(tree) - 1, score, round(secs * 1e3, 3), depths[name])
                        best = max(depths.values(), default=0)
                        if best:
                            who = "+".join(sorted(n for n, dd in depths.items() if dd == best))
                            members[(pass_, m, "path from")][who] += 1
                        members[(pass_, m, "path from")]["steps"] += 1
                        dump.append(rec)
                print(
                    f"{time.strftime('%H:%M:%S')} q{picked[i]} {pass_} {m}: {st.new_tokens / st.t_decode:.1f} tok/s, "
                    f"mean acc {st.mean_accepted_length:.2f}, rows/step {1 + st.drafted_tokens / max(1, len(st.steps)):.2f}",
                    flush=True,
                )
    for pass_ in passes:
        base = agg[(pass_, "plain")]
        print(
            f"\n## {pass_}\nmethod | tok/s | x plain | committed/step | rows/step | verify ms | draft ms | rest ms | =plain"
        )
        for m in methods:
            g = agg[(pass_, m)]
            steps = max(1, g["steps"])
            print(
                f"{m} | {g['tokens'] / g['t']:.1f} | {(g['tokens'] / g['t']) / (base['tokens'] / base['t']):.3f} | "
                f"{g['tokens'] / steps:.2f} | {g['rows'] / steps:.2f} | {g['verify'] / steps * 1e3:.2f} | "
                f"{g['draft'] / steps * 1e3:.2f} | {g['rest'] / steps * 1e3:.2f} | {int(g['same'])}/{int(g['n'])}"
            )
        for (p, meth, name), mm in members.items():
            if p != pass_:
                continue
            if name == "path from":
                print(f"  {meth}: steps whose accepted path came from: {dict(mm)}")
            else:
                print(
                    f"  {meth} member {name}: {mm['secs'] / mm['calls'] * 1e3:.2f} ms/call, "
                    f"{mm['nodes'] / mm['calls']:.2f} nodes/call, {mm['accepted'] / mm['calls']:.2f} accepted/call, "
                    f"{int(mm['calls'])} calls"
                )
    print(
        "\nverify ms by rows (all methods, this run): "
        + ", ".join(
            f"{r}: {statistics.median(v) * 1e3:.1f} (n={len(v)})" for r, v in sorted(by_rows.items()) if len(v) >= 5
        )
    )
    if a.json:
        a.json.write_text("\n".join(json.dumps(r) for r in dump) + "\n")


if __name__ == "__main__":
    main()

"""Per-step diff of hybrid-suffix against a variant of its suffix member (e.g. priced=0,follow=0), real model.

Builds both as benchmarks/suffix_repeated.py does (one registry.build each), prints what each build measured
(latency curve, the Medusa member's draft cost), runs one recorded prompt with a fresh copy of each and prints
the first step where the members' trees or the accepted lengths differ:

    PYTHONPATH=src python benchmarks/suffix_variant_diff.py --records benchmarks/results/sfx7-variant-20x256/records.jsonl \
        --pass turn1-cold --prompt 14 --variant priced=0,follow=0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import treedraft
from treedraft.drafters import registry
from treedraft.drafters.hybrid import fresh_copy
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore


def logged(log: list) -> None:
    """Patch the members' classes so every proposal is appended to ``log`` as (context length, class, tokens,
    parents): the engine forks drafters per request (``for_request``), so instance patches would be lost."""
    from treedraft.drafters.medusa import MedusaDrafter

    for cls, meth in ((SuffixDrafter, "propose_valued"), (MedusaDrafter, "propose")):
        f = getattr(cls, meth)
        f = getattr(f, "_orig", f)

        def wrap(self, ctx, _f=f, _name=cls.__name__):
            out = _f(self, ctx)
            t = out[0] if isinstance(out, tuple) else out
            log.append((len(ctx.tokens), _name, tuple(t.tokens), tuple(t.parents)))
            return out

        wrap._orig = f  # type: ignore[attr-defined]
        setattr(cls, meth, wrap)


def with_store(hybrid: object, recs: list[dict], pass_: str, prompt: int) -> object:
    """A fresh copy of ``hybrid``; on a warm pass (not turn1-cold) its suffix store holds what suffix_repeated.py's
    warm store held before (pass_, prompt): the plain first answers and hybrid-suffix's outputs, in run order."""
    d = fresh_copy(hybrid)
    if pass_ == "turn1-cold":
        return d
    store = SuffixStore()
    for r in recs:
        if r["pass"] == pass_ and r["prompt"] == prompt:
            break
        if (r["pass"] == "turn1-cold" and r["method"] == "plain") or (
            r["pass"] != "turn1-cold" and r["method"] == "hybrid-suffix"
        ):
            store.add(SuffixDrafter().record_tokens(r["prompt_ids"], r["output_ids"]))
    d.drafters = [dataclasses.replace(m, store=store) if isinstance(m, SuffixDrafter) else m for m in d.drafters]
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--pass", dest="pass_", default="turn1-cold")
    ap.add_argument("--prompt", default="14", help="prompt index, or a range like 10-19")
    ap.add_argument("--variant", default="priced=0,follow=0")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--verbose", action="store_true", help="print the first differing proposals")
    a = ap.parse_args()
    recs = [json.loads(ln) for ln in a.records.read_text().splitlines()]
    lo, _, hi = a.prompt.partition("-")
    prompts = range(int(lo), int(hi or lo) + 1)
    llm = treedraft.load(drafter=None, weights=a.weights)
    opts = registry.DrafterOptions(llm.model_name, llm.heads)
    builds = {}
    for name in ("default", "variant"):
        d = registry.build(
            "hybrid-suffix", llm.model, llm.tokenizer, dataclasses.replace(opts, suffix_store=SuffixStore())
        )
        if name == "variant":
            change = {
                k: type(getattr(SuffixDrafter, k))(int(v)) for k, v in (f.split("=") for f in a.variant.split(",") if f)
            }
            d.drafters = [dataclasses.replace(m, **change) if isinstance(m, SuffixDrafter) else m for m in d.drafters]
        builds[name] = d
        med = d.drafters[0]
        print(name, "draft_cost", getattr(med, "draft_cost", None), "latency", d.latency)
    for i in prompts:
        ids = next(r["prompt_ids"] for r in recs if r["pass"] == a.pass_ and r["prompt"] == i)
        recorded = {r["method"]: r["steps"] for r in recs if r["pass"] == a.pass_ and r["prompt"] == i}
        runs = {}
        for name, d in builds.items():
            log: list = []
            logged(log)
            res = llm.text.generate(ids, llm.config(max_new_tokens=a.max_new), with_store(d, recs, a.pass_, i))
            runs[name] = (log, [s.accepted for s in res.stats.steps], list(res.token_ids))
        (la, aa, oa), (lb, ab, ob) = runs["default"], runs["variant"]
        first = next((j for j, (x, y) in enumerate(zip(la, lb)) if x != y), None)
        print(
            f"prompt {i}: steps default {len(aa)} variant {len(ab)} (recorded: hybrid-suffix "
            f"{recorded.get('hybrid-suffix')}, variant {recorded.get('hybrid-suffix-sfx6')}); same output "
            f"{oa == ob}; proposals {'identical' if first is None else f'first differ at #{first}'} "
            f"({len(la)} / {len(lb)} logged)",
            flush=True,
        )
        if first is not None and a.verbose:
            print(" default:", la[first], "\n variant:", lb[first])


if __name__ == "__main__":
    main()

"""Where an EAGLE speculative step spends its time: draft phases vs the target's verify forward.

Greedy generations with the shipped EAGLE drafter at several node budgets; the drafter's phases are
timed by wrapping its methods (commit of the accepted pairs, the draft layer per depth, the draft-vocab
head, top-k + tree bookkeeping), the target's forward by wrapping its native FusedDecoder.

    python benchmarks/eagle_profile.py [--weights int4] [--prompts 2] [--tokens 64] [--nodes 4 8 16]
        [--drafter eagle|eagle-lookup] [--full-tree] [--depth D] [--topk K] [--heads DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import treedraft
from treedraft.engine import GenerationConfig, GenerationStats, acceptance_per_depth
from treedraft.models import fused

DATA = Path("/work/shared/data/mt_bench_questions.jsonl")


class Timer:
    """Adds wall seconds per phase name."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        """fn, timed under ``name``."""

        def timed(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            self.s[name] += time.perf_counter() - t
            self.n[name] += 1
            return out

        return timed


class TimedDecoder:
    """The target's native decoder with its forward timed."""

    def __init__(self, dec, timer: Timer) -> None:
        self.dec, self.forward = dec, timer.wrap("target_forward", dec.forward)


def by_rows(tm: Timer, native):
    """The native draft step timed per kind of call: the commit (causal, mask None) vs one tree depth."""

    def timed(feats, toks, pos, cache, start, mask, rows):
        kind = "draft_commit" if mask is None else f"draft_depth_e{int(toks.shape[0])}"
        return tm.wrap(kind, native)(feats, toks, pos, cache, start, mask, rows)

    return timed


def main() -> None:
    """Profile and print one JSON line per node budget."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument(
        "--full-tree", action="store_true", help="no expected-gain sizing: every tree fills --nodes (draft quality)"
    )
    ap.add_argument("--depth", type=int, default=None, help="draft depth (default: the drafter's)")
    ap.add_argument("--topk", type=int, default=None, help="children per expanded node (default: the drafter's)")
    ap.add_argument("--heads", default=None, help="EAGLE drafter directory (default: the shipped one)")
    ap.add_argument(
        "--draft-weights",
        default=None,
        help="format of the draft layer's native linears, q8 or q4 (default: the copy the registry chose here)",
    )
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    qs = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[: a.prompts]]
    prompts = [llm.encode_prompt(q) for q in qs]
    d = llm.get_drafter(a.drafter) if a.heads is None else llm.get_drafter(a.drafter, heads=a.heads)
    eag = next((m for m in (d, *getattr(d, "drafters", ())) if m.name == "eagle"), None)
    if eag is not None and a.draft_weights is not None:
        if d is not eag:
            raise SystemExit("--draft-weights: only with --drafter eagle")
        from treedraft.drafters.registry import DrafterOptions, eagle_dir, priced_eagle

        where = eagle_dir(DrafterOptions(model_name=llm.model_name, heads=a.heads))
        d = eag = priced_eagle(llm.drafters.target, where, llm.model_name, a.draft_weights)
    if eag is not None and a.full_tree:
        eag.curve, eag.nodes = None, 0
    if eag is not None and a.depth:
        eag.depth = a.depth
    if eag is not None and a.topk:
        eag.topk = a.topk
    st = fused._state(llm.model)
    for n in a.nodes:
        tm = Timer()
        st.decoder = TimedDecoder(st.decoder if not isinstance(st.decoder, TimedDecoder) else st.decoder.dec, tm)
        saved = {}
        if eag is not None:
            for name in ("_commit", "propose"):
                saved[name] = getattr(eag, name)
                setattr(eag, name, tm.wrap(name, saved[name]))
            if eag.native is not None:
                saved["native"] = eag.native
                eag.native = by_rows(tm, saved["native"])
            else:
                eag.net.forward = tm.wrap("draft_layer", eag.net.forward)
            if eag.project is not None:
                saved["project"] = eag.project
                eag.project = tm.wrap("draft_head", eag.project)
        toks = steps = acc = 0
        wall = expected = 0.0
        tot_s: dict[str, float] = defaultdict(float)
        tot_n: dict[str, int] = defaultdict(int)
        pairs: list[tuple[int, int]] = []
        nodes_verified = 0
        for p in prompts:
            stats = GenerationStats()
            cfg = GenerationConfig(max_new_tokens=a.tokens, max_tree_nodes=n, ignore_eos=True)
            with torch.inference_mode():
                gen = llm.engine.decode(p, cfg, d, stats)
                next(gen)  # the prefill's token: not a speculative step
                s0, n0, k0 = dict(tm.s), dict(tm.n), len(stats.steps)
                t0 = time.perf_counter()
                for _ in gen:
                    if eag is not None:
                        expected += eag.last_expected
                wall += time.perf_counter() - t0
                for key in list(tm.s):
                    tot_s[key] += tm.s[key] - s0.get(key, 0.0)
                    tot_n[key] += tm.n[key] - n0.get(key, 0)
            toks += stats.new_tokens - 1
            steps += len(stats.steps) - k0
            acc += sum(s.accepted for s in stats.steps[k0:])
            pairs += [(s.tree_depth, s.accepted) for s in stats.steps[k0:]]
            nodes_verified += sum(s.tree_size - 1 for s in stats.steps[k0:])
        for name, fn in saved.items():
            setattr(eag, name, fn)
        if eag is not None and "draft_layer" in tm.s:
            del eag.net.forward
        ms = {k: round(1000 * v / steps, 2) for k, v in tot_s.items()}
        per_call = {k: round(1000 * v / max(1, tot_n[k]), 2) for k, v in tot_s.items()}
        print(
            json.dumps(
                {
                    "nodes": n,
                    "tok_per_s": round(toks / wall, 1),
                    "mean_accepted": round(acc / steps + 1, 2),
                    "draft_expected": round(expected / steps, 2),
                    "draft_nodes_verified_per_step": round(nodes_verified / steps, 2),
                    "accepted_per_step": round(acc / steps, 2),
                    "calibration": round(eag.calibration, 3) if eag is not None else None,
                    "acceptance_per_depth": [round(x, 3) for x in acceptance_per_depth(pairs)],
                    "ms_per_step": round(1000 * wall / steps, 2),
                    "phase_ms_per_step": ms,
                    "calls_per_step": {k: round(v / steps, 2) for k, v in tot_n.items()},
                    "ms_per_call": per_call,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

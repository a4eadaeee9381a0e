"""Step costs learned in decoding (``treedraft/step_costs.py``) on and off, side by side in one process.

Per MT-Bench question (every one of the first ``--prompts``, ``--rounds`` times): plain decoding, then each method with
the learner on and off, in a shuffled order (seeded), each generation with a fresh drafter (nothing learned from the
earlier requests' outputs). What was learned is kept across generations, as in a long-lived process; "off" only
stops using and feeding it (``StepCosts.set_enabled``). ``--compare anchor``: instead of off, the learner before
session 43 ("old": any one-row step is the anchor, exploration one step at a time) against the current rule ("on":
one-row steps after a one-row step, exploration in bursts); each arm keeps its own learned state, swapped in
before each of its generations. ``prompt-lookup`` is not sized on the curve: it is the
control, its on/off ratio is the noise of the comparison. ``--turn 2``: the second turns, with the model's own
greedy first answer (``--tokens`` long) in the context. Prints tokens/s, x plain, tokens per step, the median of the
per-question on/off ratios, the learned shape and whether every output equals plain decoding's.

    python benchmarks/learned_costs_ab.py [--weights int4] [--prompts 10] [--tokens 256] [--rounds 3] [--turn 1]
        [--methods hybrid-suffix,prompt-lookup] [--compare on-off|anchor]
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import statistics

from turn2_ceiling import ab_prompts, add_ab_args  # benchmarks/ is on sys.path when run as a script

import treedraft
import treedraft.step_costs
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig
from treedraft.models.plan import machine_key
from treedraft.step_costs import step_costs_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_args(ap, "hybrid-suffix,prompt-lookup")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", choices=("on-off", "anchor"), default="on-off")
    a = ap.parse_args()
    llm = treedraft.load(weights=a.weights)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    base = {m: llm.get_drafter(m) for m in methods}
    costs = step_costs_of(llm.model)
    if costs is None:
        raise SystemExit("no learner: none of --methods is sized on the latency curve, or TREEDRAFT_LEARN_COSTS=0")
    prompts = ab_prompts(llm, a)
    print(
        f"CPU {machine_key()['cpu']}; weights {a.weights}; turn {a.turn}; {len(prompts)} prompts x {a.tokens} x {a.rounds}"
    )
    cfg = GenerationConfig(max_new_tokens=a.tokens)
    off_name = "off" if a.compare == "on-off" else "old"
    arms: dict[bool, dict] = {}  # --compare anchor: each arm's learned state (True: the current rule)
    state_keys = ("log_ratio", "weight", "_pending", "_since_one", "_burst", "_last_rows", "_shape", "_drafting")
    state_keys += ("_first_drafts", "sustained_anchor")
    current = [True]

    def use_arm(on: bool) -> None:
        if a.compare == "on-off":
            costs.set_enabled(on)
            return
        if current[0] == on and arms:
            return
        arms[current[0]] = {k: copy.deepcopy(getattr(costs, k)) for k in state_keys}
        if on not in arms:  # a fresh learner under the other rule
            arms[on] = {k: copy.deepcopy(getattr(treedraft.step_costs.StepCosts(costs.prior), k)) for k in state_keys}
            arms[on]["sustained_anchor"] = on
        for k, v in arms[on].items():
            setattr(costs, k, copy.deepcopy(v))
        costs.version += 1  # every drafter's curve rebuilds from this arm's shape
        current[0] = on

    rng = random.Random(a.seed)
    tot: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    pair: dict[str, list[float]] = collections.defaultdict(list)  # per question: on / off tokens/s
    ref: dict[int, list[int]] = {}
    mismatches = 0

    def run(i: int, method: str | None) -> float:
        nonlocal mismatches
        res = llm.engine.generate(prompts[i], cfg, None if method is None else fresh_copy(base[method]))
        ref.setdefault(i, res.token_ids)
        mismatches += res.token_ids != ref[i]
        s = res.stats
        arm = costs.enabled if a.compare == "on-off" else current[0]
        key = "plain" if method is None else method + (" on" if arm else " " + off_name)
        t = tot[key]
        t[0], t[1], t[2] = t[0] + s.t_decode, t[1] + s.new_tokens, t[2] + len(s.steps)
        return s.new_tokens / s.t_decode

    for r in range(a.rounds):
        for i in range(len(prompts)):
            run(i, None)
            order = [(m, on) for m in methods for on in (False, True)]
            rng.shuffle(order)
            got = {}
            for m, on in order:
                use_arm(on)
                got[m, on] = run(i, m)
            for m in methods:
                pair[m].append(got[m, True] / got[m, False])
        use_arm(True)
        p = tot["plain"][1] / tot["plain"][0]
        print(f"after round {r + 1}:")
        for k, (t, n, steps) in tot.items():
            print(f"  {k:22s} {n / t:7.1f} tok/s  {n / t / p:.3f}x plain  {n / steps:.2f} tokens/step")
        for m in methods:
            print(
                f"  {m}: on / {off_name} per question, median {statistics.median(pair[m]):.3f} ({len(pair[m])} pairs)"
            )
        shape = costs.shape()
        if shape is not None:
            pts = dict(zip(costs.sizes.astype(int).tolist(), shape.round(2).tolist()))
            print(f"  learned shape (x the curve's, one row = 1): {pts}; observations {costs.weight.round().tolist()}")
        for name in ("medusa",):
            got_cost, curve_1 = costs.draft_cost(name), float(costs.prior[1])
            if got_cost is not None:
                print(
                    f"  {name} propose on the curve's scale: {got_cost * 1e3:.2f} ms (one row {curve_1 * 1e3:.2f} ms)"
                )
    print(f"outputs = plain: {'all' if mismatches == 0 else f'{mismatches} MISMATCHES'}")


if __name__ == "__main__":
    main()

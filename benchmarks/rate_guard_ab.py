"""The scheduler's rate guard (``scheduler.GUARD_*``) on and off, side by side in one process.

Per MT-Bench question: plain decoding, then each method with the guard on and off in a shuffled order (seeded), each
generation with a fresh drafter (nothing learned from earlier requests' outputs; the step-cost learner is shared, as in
a long-lived process). ``prompt-lookup`` is not sized on the learned curve, so the guard never acts on it: it is the
control, its on/off ratio the noise of the comparison. ``--turn 2``: second turns, the model's own greedy first answer
(``--tokens`` long) in the context. Prints tok/s, x plain, tokens per step, the median per-question on/off ratio,
how many steps the guard paused, and whether every output equals plain decoding's.

    python benchmarks/rate_guard_ab.py [--weights int4] [--prompts 10] [--start 0] [--tokens 256] [--turn 1]
        [--methods hybrid-suffix,suffix,prompt-lookup]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics

from turn2_ceiling import ab_prompts, add_ab_args  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.engine import GenerationConfig
from treedraft.models.plan import machine_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ab_args(ap, "hybrid-suffix,suffix,prompt-lookup")
    a = ap.parse_args()
    llm = treedraft.load(weights=a.weights)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    base = {m: llm.get_drafter(m) for m in methods}
    prompts = ab_prompts(llm, a)
    print(f"CPU {machine_key()['cpu']}; weights {a.weights}; turn {a.turn}; {len(prompts)} prompts x {a.tokens}")
    cfg = GenerationConfig(max_new_tokens=a.tokens)
    rng = random.Random(a.seed)
    tot: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0, 0, 0])
    pair: dict[str, list[float]] = collections.defaultdict(list)
    ref: dict[int, list[int]] = {}
    mismatches = 0

    def run(i: int, method: str | None, on: bool) -> float:
        nonlocal mismatches
        os.environ["TREEDRAFT_RATE_GUARD"] = "1" if on else "0"  # read by each generation's scheduler
        res = llm.engine.generate(prompts[i], cfg, None if method is None else fresh_copy(base[method]))
        ref.setdefault(i, res.token_ids)
        mismatches += res.token_ids != ref[i]
        s = res.stats
        t = tot["plain" if method is None else f"{method} {'on' if on else 'off'}"]
        plain_steps = sum(1 for st in s.steps if st.tree_size == 1)
        t[0], t[1], t[2], t[3] = t[0] + s.t_decode, t[1] + s.new_tokens, t[2] + len(s.steps), t[3] + plain_steps
        return s.new_tokens / s.t_decode

    for i in range(len(prompts)):
        run(i, None, False)
        order = [(m, on) for m in methods for on in (False, True)]
        rng.shuffle(order)
        got = {(m, on): run(i, m, on) for m, on in order}
        for m in methods:
            pair[m].append(got[m, True] / got[m, False])
        print(i, end=" ", flush=True)
    print()
    p = tot["plain"][1] / tot["plain"][0]
    for k, (t, n, steps, ones) in sorted(tot.items()):
        print(
            f"  {k:22s} {n / t:7.1f} tok/s  {n / t / p:.3f}x plain  {n / steps:.2f} tokens/step  one-row {ones / steps:.0%}"
        )
    for m in methods:
        print(f"  {m}: on / off per question, median {statistics.median(pair[m]):.3f} ({len(pair[m])} pairs)")
    print(f"outputs = plain: {'all' if mismatches == 0 else f'{mismatches} MISMATCHES'}")


if __name__ == "__main__":
    main()

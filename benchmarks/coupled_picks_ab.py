"""Coupled drafting picks A/B: sampled requests drafted with the perturbed top-k (the draft's log q plus the
target's Gumbel noise, drafters/eagle_tree.coupled_pick) against the plain top-k children, interleaved per prompt.

One process, MT-Bench first turns, each prompt seeded (``--seed`` + i): plain, then every (method, picks) pair in
an order rotated per prompt; every output must equal plain's (the picks only change the drafts). Prints tok/s,
x plain and mean accepted length per pair.

    python benchmarks/coupled_picks_ab.py [--weights int4] [--methods eagle-lookup,eagle,hybrid-suffix]
        [--temperature 1.0] [--top-p 1.0] [--prompts 12] [--tokens 128]

Session 38 (Zen 4, int4, 16 x 128), mean accepted top-k -> perturbed (x plain): T 1 eagle-lookup 1.20 -> 1.59
(0.98x -> 1.05x), eagle 1.20 -> 1.54 (0.98x -> 1.07x), the default hybrid-suffix 1.18 -> 1.27 (0.99x -> 1.01x);
T 0.7 + top-p 0.9 eagle-lookup 1.60 -> 1.75 (1.14x -> 1.16x), hybrid-suffix 1.43 -> 1.47 (1.14x both).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from heads_ab import interleaved  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters import draft_model, eagle, eagle_tree, medusa
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import read_prompt_file

MTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
REAL = eagle_tree.coupled_pick


def use_picks(on: bool) -> None:
    """Coupled picks in every drafter that takes them (on), or none: the top-k children (off)."""
    f = REAL if on else (lambda *a, **k: None)
    for mod in (eagle, draft_model, medusa):
        mod.coupled_pick = f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--methods", default="eagle-lookup,eagle,hybrid-suffix")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--data", default=str(MTB))
    a = ap.parse_args()
    if a.temperature <= 0:
        raise SystemExit("--temperature must be > 0: greedy requests draft no coupled picks")
    llm = treedraft.load(drafter=None, weights=a.weights)
    prompts = [p.text for p in read_prompt_file(a.data)][a.skip : a.skip + a.prompts]
    built = {m: llm.get_drafter(m) for m in a.methods.split(",")}
    keys = [(m, on) for m in built for on in (False, True)]
    for m, on in keys:  # warm-up (and the per-machine measurements a first use makes)
        use_picks(on)
        llm.generate("Hello", drafter=fresh_copy(built[m]), max_new_tokens=8, temperature=a.temperature, seed=1)
    tot = {k: [0, 0.0, 0] for k in [("plain", False), *keys]}

    def drafter_for(key: tuple[str, bool]):
        use_picks(key[1])
        return fresh_copy(built[key[0]])

    for i, text in enumerate(prompts):
        ids = llm.encode_prompt(text)
        cfg = llm.config(max_new_tokens=a.tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed + i)
        interleaved(llm, ids, cfg, ("plain", False), keys, drafter_for, a.skip + i, tot)
        print(f"prompt {a.skip + i} done, load {os.getloadavg()[0]:.1f}", flush=True)
    use_picks(True)
    base = tot[("plain", False)][0] / tot[("plain", False)][1]
    print(f"\n{a.weights}, T {a.temperature} top_p {a.top_p}, {len(prompts)} first turns x {a.tokens}; all = plain")
    print("| method | children | tok/s | x plain | mean accepted |\n|---|---|---|---|---|")
    for (m, on), (n, sec, steps) in tot.items():
        kind = "-" if m == "plain" else "perturbed top-k" if on else "top-k"
        print(f"| {m} | {kind} | {n / sec:.1f} | {n / sec / base:.3f} | {n / max(steps, 1):.2f} |")


if __name__ == "__main__":
    main()

"""Medusa heads A/B in situ: the default drafter (and ``medusa`` alone) built with each heads directory, side by side.

One process, int4, greedy, MT-Bench first turns: per prompt plain, then every (method, heads) pair in an order
rotated per prompt (no variant always runs first after plain); every output must equal plain's. Prints tok/s,
x plain and mean accepted length per pair: the speed figures are ratios taken in one window on a noisy host.

    python benchmarks/heads_ab.py --heads src/treedraft/heads/smollm2-135m-instruct NEW_DIR [--prompts 20]
        [--tokens 256] [--methods hybrid-suffix,medusa] [--skip 0] [--turn 2]

``--methods eagle@q8,eagle@q4``: the EAGLE drafter with its draft layer's native copy in q8 and in q4;
``hybrid-suffix@q4``: the Medusa member's projection in q4 (drafters/draft_format.py); without ``@``: as chosen.

``--temperature T [--top-p P]``: sampled, prompt i seeded with ``--seed`` + i (seeded draws are coupled, so every
output must still equal plain's).

``--turn 2``: the MT-Bench second turns instead, with plain's greedy first answer in the context (as
benchmarks/turn2_methods.py builds them); each (method, heads) pair drafts from its own fresh copy.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import read_prompt_file

MTB = "/work/shared/data/mt_bench_questions.jsonl"


def build(llm, method: str, heads: str):
    """``method`` from the registry with ``heads``; ``method@FORMAT``: with the drafter's native weight copy in that
    format (EagleDrafter.for_target's draft_weights, MedusaDrafter.for_target's proj_format)."""
    if "@" not in method:
        return llm.get_drafter(method, heads=heads)
    name, weights = method.split("@")
    if name != "eagle":  # the Medusa member's projection in that format (its own machine tree and draft cost)
        import dataclasses

        from treedraft.drafters.medusa import MedusaDrafter
        from treedraft.drafters.registry import _REGISTRY, canonical

        cache, orig = llm.drafters, MedusaDrafter.for_target
        MedusaDrafter.for_target = staticmethod(
            lambda t, h, n=None, proj_format=None, latency=None: orig(t, h, n, weights, latency)
        )
        try:  # a fresh build: its own heads object, not the registry's cached one
            opts = dataclasses.replace(cache.options, heads=heads)
            return _REGISTRY[canonical(name)].factory(cache.target, cache.tokenizer, opts)
        finally:
            MedusaDrafter.for_target = orig
    from treedraft.drafters.registry import DrafterOptions, eagle_dir, priced_eagle

    where = eagle_dir(DrafterOptions(model_name=llm.model_name, heads=heads))
    return priced_eagle(llm.drafters.target, where, llm.model_name, weights)


def interleaved(llm, ids, cfg, plain_key, keys, drafter_for, i: int, tot: dict) -> None:
    """Prompt ``i``: plain decoding, then each key's drafter (``drafter_for(key)``, called right before its run) in an
    order rotated by ``i`` (no variant always runs first after plain); every output must equal plain's. Adds
    (new tokens, decode seconds, steps) to ``tot[key]`` (and ``tot[plain_key]``)."""
    ref = llm.text.generate(ids, cfg, None)
    runs = [(plain_key, ref)]
    for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
        res = llm.text.generate(ids, cfg, drafter_for(key))
        if list(res.token_ids) != list(ref.token_ids):
            raise SystemExit(f"{key} prompt {i}: output differs from plain's")
        runs.append((key, res))
    for key, res in runs:
        t = tot[key]
        t[0] += res.stats.new_tokens
        t[1] += res.stats.t_decode
        t[2] += len(res.stats.steps)


def main() -> None:
    """Interleaved per prompt; totals per (method, heads)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", nargs="+", required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--skip", type=int, default=0, help="start at this MT-Bench question")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", default="hybrid-suffix,medusa")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--data", default=MTB)
    ap.add_argument("--turn", type=int, choices=(1, 2), default=1)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled, seeded per prompt (--seed + i)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    if a.turn == 1:
        prompts = [p.text for p in read_prompt_file(a.data)][a.skip : a.skip + a.prompts]
    else:
        from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

        qs = [json.loads(ln) for ln in Path(a.data).read_text().splitlines() if ln.strip()]
        prompts = [second_turn(llm, q, a.tokens)[1] for q in qs[a.skip : a.skip + a.prompts]]
    pairs = [(m, h) for m in a.methods.split(",") for h in a.heads]
    built = {(m, h): build(llm, m, h) for m, h in pairs}
    for d in built.values():  # warm-up (and the per-machine measurements a first use makes)
        llm.generate("Hello", drafter=fresh_copy(d), max_new_tokens=8)
    tot = {k: [0, 0.0, 0] for k in [("plain", "-"), *pairs]}
    for i, text in enumerate(prompts):
        ids = llm.encode_prompt(text)  # a user string, or the second turn's messages
        cfg = llm.config(max_new_tokens=a.tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed + i)
        interleaved(llm, ids, cfg, ("plain", "-"), pairs, lambda key: fresh_copy(built[key]), a.skip + i, tot)
        print(f"prompt {a.skip + i} done, load {os.getloadavg()[0]:.1f} {time.strftime('%H:%M:%S')}", flush=True)
    base = tot[("plain", "-")][0] / tot[("plain", "-")][1]
    print(
        f"\n{len(prompts)} {'first' if a.turn == 1 else 'second'} turns x {a.tokens}, {a.weights}, "
        + ("greedy" if a.temperature == 0 else f"T {a.temperature} top_p {a.top_p}, seeded")
        + "; all outputs = plain"
    )
    print("| method | heads | tok/s | x plain | mean accepted |\n|---|---|---|---|---|")
    for key, (n, sec, steps) in tot.items():
        print(f"| {key[0]} | {key[1]} | {n / sec:.1f} | {n / sec / base:.3f} | {n / max(steps, 1):.2f} |")


if __name__ == "__main__":
    main()

"""Decoding with float32 against bf16 attention scores (``--attn-scores``), side by side in one process.

Per prompt, both modes in an order that alternates: plain decoding and each ``--methods`` drafter; each mode's
drafted outputs must equal its own plain output (the two modes' texts differ: near-ties flip). Prints tok/s, x plain
and mean accepted per mode and method, and the bf16 / float32 speed ratio per method.

    python benchmarks/attn_scores_insitu.py [--turn 2] [--prompts 80] [--methods hybrid-suffix,hybrid]

Session 35 (Zen 4, int4): all 80 second turns x 256: the default 1.038x, ``hybrid`` 1.038x, plain 1.004x; 40 first
turns 1.002x / 1.000x / 1.000x.
"""

from __future__ import annotations

import argparse
import json

import torch
from turn2_ceiling import second_turn  # benchmarks/ is on sys.path when run as a script

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import MT_BENCH_FILE, find_shared_data, read_prompt_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turn", type=int, choices=(1, 2), default=2)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--methods", default="hybrid-suffix")
    ap.add_argument("--weights", default="int4")
    a = ap.parse_args()
    torch.set_num_threads(2)
    llm = treedraft.load(drafter=None, weights=a.weights, attn_scores="bf16")
    m = llm.model
    path = find_shared_data(MT_BENCH_FILE)
    if a.turn == 1:
        prompts = [p.text for p in read_prompt_file(path)][: a.prompts]
    else:
        qs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        prompts = [second_turn(llm, q, a.tokens)[1] for q in qs[: a.prompts]]
    drafters = {x: llm.get_drafter(x) for x in a.methods.split(",")}
    for d in drafters.values():
        llm.generate("Hello", drafter=fresh_copy(d), max_new_tokens=8)
    tot: dict[tuple[bool, str], list] = {}
    for i, text in enumerate(prompts):
        ids = llm.encode_prompt(text)
        cfg = llm.config(max_new_tokens=a.tokens)
        for bf16 in (False, True) if i % 2 else (True, False):
            m.bf16_scores = bf16
            ref = llm.text.generate(ids, cfg, None)
            runs = [("plain", ref)]
            for name, d in drafters.items():
                r = llm.text.generate(ids, cfg, fresh_copy(d))
                if list(r.token_ids) != list(ref.token_ids):
                    raise SystemExit(
                        f"{name} prompt {i} ({'bf16' if bf16 else 'float32'}): output differs from plain's"
                    )
                runs.append((name, r))
            for name, r in runs:
                t = tot.setdefault((bf16, name), [0, 0.0, 0])
                t[0] += r.stats.new_tokens
                t[1] += r.stats.t_decode
                t[2] += len(r.stats.steps)
        print(f"prompt {i} done", flush=True)
    names = ["plain", *drafters]
    print(f"\n{len(prompts)} {'first' if a.turn == 1 else 'second'} turns x {a.tokens}, {a.weights}; outputs = plain")
    print("| scores | method | tok/s | x plain | mean accepted |\n|---|---|---|---|---|")
    for bf16 in (False, True):
        base = tot[(bf16, "plain")][0] / tot[(bf16, "plain")][1]
        for name in names:
            n, sec, steps = tot[(bf16, name)]
            mode = "bf16" if bf16 else "float32"
            print(f"| {mode} | {name} | {n / sec:.1f} | {n / sec / base:.3f} | {n / steps:.2f} |")
    for name in names:
        f, b = tot[(False, name)], tot[(True, name)]
        print(f"{name}: bf16 / float32 tok/s = {(b[0] / b[1]) / (f[0] / f[1]):.3f}")


if __name__ == "__main__":
    main()

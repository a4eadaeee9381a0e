"""How many draft-vocabulary ids the Medusa heads need to score: acceptance and drafting time per size.

The shipped heads share the target's lm_head restricted to a frequency-ranked vocabulary (``vocab_map`` in the
heads file, 16,384 ids). Every propose streams that (ids x hidden) int8 projection, so scoring only the first N
ids costs N/16384 of it. For each N (interleaved over ``--rounds``), generates the MT-Bench first turns (every
80/P-th question) greedily with ``--method`` (fresh drafter per prompt) and prints tokens per step (the mean
accepted length incl. the bonus token: hardware-independent), tokens/s and drafting ms per step. The outputs
are the target's greedy ones whatever N (checked against the first size's).

    python benchmarks/medusa_draft_vocab.py [--prompts 20] [--tokens 128] [--method medusa] [--sizes 16384,4096]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from safetensors.torch import load_file

import treedraft
from treedraft.drafters.hybrid import fresh_copy
from treedraft.drafters.medusa import shipped_heads_for
from treedraft.prompts import MT_BENCH_FILE, find_shared_data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--method", default="medusa", help="medusa, or a hybrid whose first member is the heads")
    ap.add_argument("--sizes", default="16384,8192,4096")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    llm = treedraft.load(weights="int4")
    qs = [json.loads(line)["turns"][0] for line in open(find_shared_data(MT_BENCH_FILE))]
    qs = qs[:: max(1, len(qs) // a.prompts)][: a.prompts]
    base = llm.get_drafter(a.method)
    med = base if a.method == "medusa" else base.drafters[0]
    heads = med.heads
    d = shipped_heads_for(llm.model_name)
    if d is None:
        raise SystemExit(f"no Medusa heads shipped for {llm.model_name}")
    vm = load_file(str(d / "heads.safetensors"))["vocab_map"].long()  # the file's whole ranked vocabulary
    lm = llm.model.output_projection_weight()
    sizes = [int(x) for x in a.sizes.split(",")]
    if max(sizes) > len(vm):
        raise SystemExit(f"the heads file ranks {len(vm)} ids; --sizes asks for {max(sizes)}")
    ref: list[list[int]] | None = None
    print(f"{a.method}, {len(qs)} prompts x {a.tokens} tokens, int4, greedy")
    print("| draft ids | tokens / step | tok/s | draft ms / step |")
    print("|---|---|---|---|")
    for _ in range(a.rounds):
        for n in sizes:
            heads.config = dataclasses.replace(heads.config, draft_vocab=n)  # as a medusa.json saying n would
            heads.set_base(lm, vm)
            heads.pack_for_drafting()
            steps = toks = 0
            wall = draft = 0.0
            outs = []
            for q in qs:
                t0 = time.perf_counter()
                r = llm.generate(q, drafter=fresh_copy(base), max_new_tokens=a.tokens)
                wall += time.perf_counter() - t0
                steps += len(r.stats.steps)
                toks += r.stats.new_tokens
                draft += sum(s.t_draft for s in r.stats.steps)
                outs.append(list(r.token_ids))
            if ref is None:
                ref = outs
            elif outs != ref:
                raise SystemExit(f"draft ids {n}: an output differs from the first size's (greedy must not change)")
            print(f"| {n} | {toks / steps:.3f} | {toks / wall:.1f} | {1000 * draft / steps:.3f} |", flush=True)


if __name__ == "__main__":
    main()

"""Offline estimate: how often the target's Gumbel-max draw is among the EAGLE drafter's depth-1 children, for the
top-k of q, the perturbed top-k (top-k of log q + the target's noise: drafters/eagle_tree.coupled_pick) and a mix
(the perturbed top-1, then q's top-k).

Runs the int4 target with ``eagle`` on MT-Bench first turns (sampled, T 1), records the drafter's depth-1 logits and
the target's logits at the same position (teacher-forced over the finished text), then draws 10 noise keys per
position for each temperature / top-p setting: the target's draw is the Gumbel-max draw of its row, the draft's
children come from its row under the same key.

    python benchmarks/coupled_picks_estimate.py [--prompts 8] [--tokens 96]

Session 38 (Zen 4; quality figures do not depend on the machine), 461 positions, hit rate top-1 / top-2 / top-4:
T 1: top-k 0.241 / 0.319 / 0.402, perturbed 0.342 / 0.457 / 0.557, mix 0.342 / 0.434 / 0.495;
T 0.7 + top-p 0.9: top-k 0.324 / 0.428 / 0.533, perturbed 0.363 / 0.479 / 0.555;
T 0.4: top-k 0.367 / 0.474 / 0.580, perturbed 0.390 / 0.507 / 0.598.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import treedraft
from treedraft.drafters import eagle
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import read_prompt_file
from treedraft.sampling import SamplingParams, gumbel_key, gumbel_topk

MTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
SETTINGS = ((1.0, 1.0), (0.7, 0.9), (0.7, 1.0), (0.4, 1.0))


def record_depth1(llm, prompts: list[str], tokens: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(target row, draft depth-1 row, draft columns' token ids) at every position the drafter proposed for."""
    rec: list = []
    cur: dict = {}
    grow, propose = eagle.grow_tree, eagle.EagleDrafter.propose

    def grow_rec(root, first_logits, expand, **kw):
        rec.append((cur["r"], first_logits[0].detach().float().clone(), kw.get("vocab")))
        return grow(root, first_logits, expand, **kw)

    def propose_rec(self, ctx):
        cur["r"] = len(ctx.tokens) - 1
        return propose(self, ctx)

    eagle.grow_tree, eagle.EagleDrafter.propose = grow_rec, propose_rec
    d = llm.get_drafter("eagle")
    pairs = []
    try:
        for i, text in enumerate(prompts):
            rec.clear()
            ids = llm.encode_prompt(text)
            res = llm.text.generate(
                ids, llm.config(max_new_tokens=tokens, temperature=1.0, seed=300 + i), fresh_copy(d)
            )
            full = list(ids) + list(res.token_ids)
            with torch.inference_mode():
                lg, _ = llm.model.forward(torch.tensor([full]), torch.arange(len(full)))
            for r, row, vocab in rec:
                if r + 1 < len(full):
                    cols = torch.from_numpy(np.asarray(vocab, dtype=np.int64))
                    pairs.append((lg[0, r].float().contiguous(), row, cols))
    finally:
        eagle.grow_tree, eagle.EagleDrafter.propose = grow, propose
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--data", default=str(MTB))
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights="int4")
    pairs = record_depth1(llm, [p.text for p in read_prompt_file(a.data)][: a.prompts], a.tokens)
    print(f"{len(pairs)} positions; hit rate of the target's draw among the first k children")
    for T, top_p in SETTINGS:
        s = SamplingParams(T, top_p=top_p)
        hits: dict[str, list[bool]] = {}
        for n, (target, draft, cols) in enumerate(pairs):
            topq = cols[torch.topk(draft, 4).indices].tolist()
            for rep in range(10):
                key = gumbel_key(n * 31 + rep, 7)
                x = int(gumbel_topk(target, s, key, 1)[0][0])
                pert = cols[torch.from_numpy(gumbel_topk(draft, s, key, 4, cols)[0])].tolist()
                mix = [pert[0]] + [t for t in topq if t != pert[0]]
                for k in (1, 2, 4):
                    for name, kids in (("top-k", topq), ("perturbed", pert), ("mix", mix)):
                        hits.setdefault(f"{name} {k}", []).append(x in kids[:k])
        print(f"T {T} top-p {top_p}: " + ", ".join(f"{k} {np.mean(v):.3f}" for k, v in hits.items()))


if __name__ == "__main__":
    main()

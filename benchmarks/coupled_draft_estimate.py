"""Offline estimate: would the Medusa heads' coupled token help sampled verification?

Coupled verification draws the target's token x_p = F_p^-1(u) with u known before drafting (a function of the
step's seed and the position). A drafter could draw x_q = F_q^-1(u) from its own distribution q with the same u
and propose it. This replays sampled plain answers, teacher-forces them, and counts how often x_p is among the
heads' depth-1 top-k, equals x_q alone, or is in top-k plus x_q.

    python benchmarks/coupled_draft_estimate.py      # MT-Bench first turns 13-24, 96 tokens each

Session 24 (Ice Lake Xeon): x_q alone 0.331 vs top-1 0.320 at T 0.7 / top-p 0.9, 0.212 vs 0.192 at T 1.0;
as an extra node (top-1 + x_q) 0.359 / 0.244 against 0.433 / 0.273 for top-2. Not built: a few points at depth 1.
"""

import json

import torch

import treedraft
from treedraft.sampling import SamplingParams, draw, position_uniform

llm = treedraft.load(drafter=None)
med = llm.drafters.get("medusa")
heads = med.heads
qs = [json.loads(l)["turns"][0] for l in open("/work/shared/data/mt_bench_questions.jsonl")][12:24]
for T, tp in ((0.7, 0.9), (1.0, 1.0)):
    params = SamplingParams(T, 0, tp, seed=1)
    hits = {k: [0, 0] for k in (1, 2, 3)}
    n = 0
    only = 0
    for qi, q in enumerate(qs):
        r = llm.generate(
            [{"role": "user", "content": q}], max_new_tokens=96, temperature=T, top_p=tp, seed=qi, drafter=None
        )
        ids = llm.encode_prompt([{"role": "user", "content": q}]) + r.token_ids
        with torch.inference_mode():
            logits, hidden = llm.model.forward(torch.tensor([ids]), torch.arange(len(ids)), None, 0)
        P = len(ids) - len(r.token_ids)
        vm = heads.vocab_map
        for t in range(P - 1, len(ids) - 2):  # hidden at t, root ids[t+1], target row for ids[t+2] is logits[t+1]
            h = hidden[0, t]
            ql = heads.draft_logits(h, torch.tensor(ids[t + 1]), 1)[0].float()
            full = torch.full((logits.shape[-1],), float("-inf"))
            if vm is not None:
                full[vm] = ql
            else:
                full = ql
            u = position_uniform(12345 + t, t + 2)
            xp = draw(logits[0, t + 1].float(), params, u)
            xq = draw(full, params, u)
            top = full.topk(3).indices.tolist()
            for k in (1, 2, 3):
                hits[k][0] += xp in top[:k]
                hits[k][1] += xp in top[:k] or xp == xq
            n += 1
            only += xp == xq
    print(
        f"T {T} top_p {tp}: n {n} xq alone {only / n:.3f}",
        {k: (round(a / n, 3), round(b / n, 3)) for k, (a, b) in hits.items()},
        flush=True,
    )

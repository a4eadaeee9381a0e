"""How well coupled_pick's values predict acceptance, by noise scale: the values are log softmax(s x T / scale) over
the 16 best perturbed scores s = log q + G of a row (drafters/eagle_tree.coupled_pick); this records every depth-1
pick's 16 best scores and whether the target's token was each of the first four, then bins the values per scale.

    python benchmarks/coupled_picks_calibration.py --drafter eagle --temperature 0.7 --top-p 0.9
    python benchmarks/coupled_picks_calibration.py --drafter draft-model --temperature 0.7

``eagle`` runs on the int4 target, ``draft-model`` (the int4 copy) on the fp32 one. Session 38 (6 prompts x 96):
EAGLE at T 1 read best near scale 1-1.25 (values 0.38 / 0.58 / 0.80 hit 0.30 / 0.47 / 0.66 at scale 1), at T 0.7 +
top-p 0.9 overconfident at 1.25 (0.65 -> 0.34): hence a scale divided by T (COUPLED_SCALE); the draft model's
perturbed top-1 was the target's token 0.986 of the time at T 0.7, where an error scale of 0.1 / T (scale 0.07)
fit it best (COUPLED_SCALE_CLOSE 0.08).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import treedraft
from treedraft.drafters import draft_model, eagle, eagle_tree
from treedraft.drafters.hybrid import fresh_copy
from treedraft.prompts import read_prompt_file
from treedraft.sampling import gumbel_key, gumbel_topk

MTB = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
BINS = [0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.01]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=("eagle", "draft-model"), default="eagle")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--data", default=str(MTB))
    a = ap.parse_args()
    rec: list = []
    real = eagle_tree.coupled_pick

    def recording(ctx, k, vocab=None, **kw):
        pick = real(ctx, k, vocab, **kw)
        if pick is None:
            return None
        first = len(ctx.tokens)
        cols = None if vocab is None else torch.from_numpy(np.ascontiguousarray(vocab, dtype=np.int64))

        def wrap(logits, depths):
            for j, d in enumerate(depths):
                if d == 0:
                    key = gumbel_key(ctx.coupling, first)
                    ids, sc = gumbel_topk(logits[j].float(), ctx.sampling, key, 16, cols)
                    rec.append((first, ids if vocab is None else vocab[ids], sc))
            return pick(logits, depths)

        return wrap

    mod, weights = (eagle, "int4") if a.drafter == "eagle" else (draft_model, "fp32")
    mod.coupled_pick = recording
    llm = treedraft.load(drafter=None, weights=weights)
    d = llm.get_drafter(a.drafter)
    rows = []
    for i, text in enumerate([p.text for p in read_prompt_file(a.data)][: a.prompts]):
        rec.clear()
        ids = llm.encode_prompt(text)
        cfg = llm.config(max_new_tokens=a.tokens, temperature=a.temperature, top_p=a.top_p, seed=70 + i)
        full = list(ids) + list(llm.text.generate(ids, cfg, fresh_copy(d)).token_ids)
        rows += [(toks, sc, full[f]) for f, toks, sc in rec if f < len(full)]
    hits = [round(float(np.mean([r[0][k] == r[2] for r in rows if len(r[0]) > k])), 3) for k in range(4)]
    print(f"{a.drafter}, T {a.temperature} top-p {a.top_p}: {len(rows)} picks; perturbed rank 1-4 hit {hits}")
    for scale in (0.1, 0.25, 0.5, 1.0, 1.25, 2.0):
        pv, hv = [], []
        for toks, sc, x in rows:
            z = sc * (a.temperature / scale)
            pr = np.exp(z - z.max())
            pr /= pr.sum()
            for r in range(min(4, len(toks))):
                pv.append(pr[r])
                hv.append(toks[r] == x)
        pv, hv = np.array(pv), np.array(hv)
        cells = []
        for lo, hi in zip(BINS, BINS[1:]):
            m = (pv >= lo) & (pv < hi)
            if m.any():
                cells.append(f"[{lo}, {hi}) n {m.sum()}: {pv[m].mean():.2f} -> {hv[m].mean():.2f}")
        print(f"scale {scale}: Brier {np.mean((pv - hv) ** 2):.4f}; value -> hit: " + "; ".join(cells))


if __name__ == "__main__":
    main()

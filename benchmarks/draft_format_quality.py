"""Medusa heads' top-1 per head through the native drafting copy, with the shared projection in q8 and in q4.

Drafting runs on rounded copies of the heads' weights (drafters/medusa_native.py); this measures what the
rounding of the projection costs in draft quality, on a data directory's answer rows (train-eagle's rows: the
hidden states the int4 target chose each answer token from, e.g. the MT-Bench answers, never trained on).
Timing-independent: the exact path ``MedusaDrafter.propose`` ranks candidates with.

    python benchmarks/draft_format_quality.py --data DIR [--rows 4000] [--heads DIR] [--formats q8,q4]
"""

from __future__ import annotations

import argparse
import json

import torch

import treedraft
from treedraft.drafters.medusa import MedusaHeads
from treedraft.drafters.registry import DEFAULT, DrafterOptions, heads_dir
from treedraft.training.data import load_shards
from treedraft.training.train import head_targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--rows", type=int, default=4000, help="answer rows evaluated (evenly spaced)")
    ap.add_argument("--heads", default=None, help="Medusa heads directory (default: the shipped ones)")
    ap.add_argument("--formats", default="q8,q4")
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights="int4")
    m = llm.model
    d = a.heads or heads_dir(DrafterOptions(model_name=llm.model_name, heads=DEFAULT))
    heads = MedusaHeads.load(
        d, m.output_projection_weight(), llm.model_name, m.hidden_size, m.vocab_size, m.input_embedding_weight()
    )
    tok, hid, seq = load_shards(a.data)
    K = heads.config.num_heads
    tgt = head_targets(tok, seq, K)
    pick = torch.linspace(0, len(tok) - 1, min(a.rows, len(tok))).long()
    vm = heads.vocab_map
    for fmt in a.formats.split(","):
        if not heads.pack_for_drafting(fmt) or heads.draft_path == "bf16":
            raise SystemExit("no native drafting copy here (treedraft.kernels unavailable)")
        hits = torch.zeros(K)
        seen = torch.zeros(K)
        with torch.inference_mode():
            for i in pick.tolist():
                top = heads.draft_logits(hid[i].float(), torch.tensor(int(tok[i])), K).argmax(-1)  # (K,)
                ids = vm[top] if vm is not None else top
                ok = tgt[i] >= 0
                hits += ((ids == tgt[i]) & ok).float()
                seen += ok.float()
        top1 = (hits / seen.clamp_min(1)).tolist()
        print(json.dumps({"format": fmt, "path": heads.draft_path, "rows": len(pick), "top1": top1}), flush=True)


if __name__ == "__main__":
    main()

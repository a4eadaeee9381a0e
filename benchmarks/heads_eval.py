"""Per-head top-1 / top-5 of Medusa heads on a data directory's answers (held-out data, e.g. the MT-Bench answers).

The data are a train-heads or train-eagle directory (train-eagle's answer rows only: the hidden states the served
model chose each answer token from, so with int4 weights bitwise what the heads read when drafting).

    python benchmarks/heads_eval.py --data DIR [--heldout FRAC --seed S] HEADS_DIR...
"""

from __future__ import annotations

import argparse
import json

import torch

import treedraft
from treedraft.drafters.medusa import MedusaHeads
from treedraft.training.data import load_shards
from treedraft.training.train import evaluate, head_targets, split_by_sequence


def main() -> None:
    """Evaluate each heads directory on the same rows; one JSON line per directory."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument(
        "--heldout",
        type=float,
        default=0.0,
        help="only this held-out fraction (train_heads' split of a single --train-data directory; with "
        "--extra-train-data the split was drawn over all directories and differs)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("heads", nargs="+")
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    tok, hid, seq = load_shards(a.data)
    if a.heldout > 0:
        keep = split_by_sequence(seq, a.heldout, a.seed)
        tok, hid, seq = tok[keep], hid[keep], seq[keep]
    for d in a.heads:
        heads = MedusaHeads.load(
            d, m.output_projection_weight(), llm.model_name, m.hidden_size, m.vocab_size, m.input_embedding_weight()
        )
        with torch.no_grad():
            r = evaluate(heads, hid, head_targets(tok, seq, heads.config.num_heads), roots=tok)
        print(json.dumps({"heads": d, "rows": len(tok), **r}), flush=True)


if __name__ == "__main__":
    main()

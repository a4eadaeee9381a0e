"""Held-out per-depth top-1 of EAGLE drafter directories on the SAME held-out sequences.

The train/held-out split of ``train-eagle`` holds out every k-th sequence in data order
(``eagle_train.split_spans``), so the held-out set of the first N shards extends the one of the first
M < N shards: no drafter trained on those shards (with the same --heldout) saw any of these sequences.

    python benchmarks/eagle_heldout.py --data /work/eagle-data/v2/data --max-shards 6 --heldout 0.1 \
        src/treedraft/heads/smollm2-135m-instruct my-eagle [--weights int4] [--depths 4]

``--all`` scores every sequence of ``--data`` instead: data that no drafter trained on, e.g. the MT-Bench first
turns' answers (the bench's prompts, not ShareGPT's), made the same way:

    treedraft train-eagle --weights int4 --max-new-tokens 256 --shard-size 80 --gen-concurrency 8 \
        --prompts ../shared/data/mt_bench_questions.jsonl --train-data mtb --gen-only
    python benchmarks/eagle_heldout.py --data mtb --all src/treedraft/heads/smollm2-135m-instruct my-eagle
"""

from __future__ import annotations

import argparse
import json

import torch

import treedraft
from treedraft.drafters.eagle import EagleNet
from treedraft.training.eagle_train import evaluate, load_eagle_shards, sequence_spans, split_spans


def main() -> None:
    """Print one JSON line per drafter directory."""
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", help="drafter directories (eagle.json + eagle.safetensors)")
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-shards", type=int, default=None)
    ap.add_argument("--heldout", type=float, default=0.1)
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--all",
        action="store_true",
        help="score every sequence of --data (data no drafter trained on, e.g. the MT-Bench answers)",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = treedraft.load(drafter=None, weights=a.weights)
    data = load_eagle_shards(a.data, a.max_shards)
    spans = sequence_spans(data["seq"])
    held = spans if a.all else split_spans(spans, a.heldout)[1]
    rows = sum(b - a_ for a_, b in held)
    for d in a.dirs:
        net = EagleNet.load(d, llm.model, llm.model_name)
        acc = evaluate(net, data, held, a.depths, 256)
        out = {
            "dir": d,
            "heldout_sequences": len(held),
            "heldout_rows": rows,
            "top1_per_depth": [round(x, 4) for x in acc],
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

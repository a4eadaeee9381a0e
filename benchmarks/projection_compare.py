"""Shared frozen lm_head vs a separate trainable projection per Medusa head: acceptance vs cost.

Both variants train on the same self-distillation shards with the same schedule and seed, then:
- per-head top-1/top-5 on the MT-Bench answers (acceptance side),
- drafting cost per engine step (heads forward on one row, median),
- the tree and tokens/s that ``calibrate.choose_tree`` expects from each variant's rank accuracies,
  under one forward-latency table measured here (cost side: what ships is the one with more tok/s).

    python benchmarks/projection_compare.py --train-data data-cache/sharegpt --eval-data data-cache/mtbench \
        --shards 4 --epochs 1        # writes benchmarks/results/projection_compare.{md,json}
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def subset(train_data: Path, shards: int, tmp: Path) -> Path:
    """A directory holding links to the first ``shards`` shards (0 = all)."""
    files = sorted(train_data.glob("shard_*.safetensors"))
    if not files:
        raise SystemExit(f"{train_data}: no shard_*.safetensors (run treedraft train-heads first)")
    for f in files[: shards or None]:
        (tmp / f.name).symlink_to(f.resolve())
    return tmp


@torch.inference_mode()
def draft_ms(heads, hidden: torch.Tensor, root: torch.Tensor, reps: int = 200) -> float:
    """Median ms of one drafting call (all heads, one row, top-10 per head)."""
    times = []
    for i in range(reps + 10):
        t = time.perf_counter()
        logits = heads(hidden[i % len(hidden)][None], root[i % len(root)][None])
        logits.topk(10, dim=-1)
        if i >= 10:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--train-data", type=Path, required=True)
    p.add_argument("--eval-data", type=Path, required=True)
    p.add_argument("--shards", type=int, default=4, help="train on the first N shards (0 = all)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "projection_compare")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    import treedraft
    from treedraft.drafters.medusa import MedusaConfig
    from treedraft.training.calibrate import choose_tree, measure_latency
    from treedraft.training.data import load_shards
    from treedraft.training.train import TrainConfig, evaluate, head_targets, rank_accuracy, train_heads

    llm = treedraft.load(a.model, drafter=None, device="cpu", dtype="fp32")
    net = llm.model
    latency = measure_latency(net, sizes=(1, 2, 4, 8, 16, 32, 64))
    tok, hid, seq = load_shards(a.eval_data)
    targets = head_targets(tok, seq, 4)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = subset(a.train_data, a.shards, Path(tmp))
        for projection in ("shared", "separate"):
            mcfg = MedusaConfig(
                base_model=llm.model_name,
                hidden_size=net.hidden_size,
                vocab_size=net.vocab_size,
                shared_lm_head=projection == "shared",
                draft_vocab=a.draft_vocab,
                root_conditioned=True,
            )
            tcfg = TrainConfig(epochs=a.epochs, lr=a.lr, seed=0)
            heads, report = train_heads(
                data,
                net.lm_head.weight,
                mcfg,
                tcfg,
                Path(tmp) / f"ckpt-{projection}",
                resume=False,
                embed_weight=net.input_embedding_weight(),
            )
            acc = evaluate(heads, hid, targets, roots=tok)
            ranks = rank_accuracy(heads, hid, targets, roots=tok)
            cost = draft_ms(heads, hid.float(), tok)
            tree = choose_tree(ranks, latency, draft_cost=cost / 1e3)
            rows[projection] = {
                "train_rows": report["train_rows"],
                "train_seconds": report["seconds"],
                "mt_bench": acc,
                "draft_ms": round(cost, 3),
                "trainable_params": sum(p.numel() for p in heads.parameters()),  # frozen lm_head is a buffer
                "tree_nodes": tree["nodes"],
                "expected_len": round(tree["expected_len"], 3),
                "expected_tok_per_s": round(tree["expected_tok_per_s"], 2),
            }
            print(projection, json.dumps(rows[projection]), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "latency_ms": {k: round(v * 1e3, 2) for k, v in latency.items()},
        "variants": rows,
    }
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Shared vs separate projection for the Medusa heads",
        "",
        f"Trained on {a.shards or 'all'} shard(s) of `{a.train_data}`, {a.epochs} epoch(s), lr {a.lr}, "
        f"draft vocabulary {a.draft_vocab}, root-conditioned; evaluated on `{a.eval_data}`. "
        f"torch threads: {torch.get_num_threads()}; one forward of k tokens (ms): "
        + ", ".join(f"k={k} {v * 1e3:.1f}" for k, v in latency.items())
        + ".",
        "",
        "| projection | trainable params | train s | MT-Bench top-1 (heads 1-4) | top-5 | draft ms/step "
        "| chosen tree nodes | expected len | expected tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t1 = " / ".join(f"{x:.3f}" for x in r["mt_bench"]["top1"])
        t5 = " / ".join(f"{x:.3f}" for x in r["mt_bench"]["top5"])
        lines.append(
            f"| {name} | {r['trainable_params']:,} | {r['train_seconds']} | {t1} | {t5} | {r['draft_ms']} "
            f"| {r['tree_nodes']} | {r['expected_len']} | {r['expected_tok_per_s']} |"
        )
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

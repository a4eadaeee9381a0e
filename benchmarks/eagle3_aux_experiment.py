"""Does an EAGLE-3-style fusion of intermediate target layers raise the EAGLE drafter's top-1? (issue 12)

Starts from a trained drafter directory (e.g. the shipped one) and adds, at the first draft depth only (the
depth that reads true target features; deeper depths read the draft's own predictions, as in EAGLE-3),
``f' = f + W [rmsnorm(layer_a); rmsnorm(layer_b)]`` with W zero-initialised: at step 0 it is exactly the starting
drafter. Trains one epoch with the shipped recipe (``--unroll 3``, lr 3e-4, CE weight 0.5, 256 tokens a batch)
on ``--data`` (+ its aux_*.safetensors from benchmarks/eagle3_aux_features.py), with ``--no-aux`` the same
epoch without the fusion (the control), and prints per-depth top-1 on ``--eval`` (every sequence) and on the
held-out split of ``--data``. ``--extra-layers N`` appends N decoder layers to the draft (a deeper drafter: copies
of its layer with the attention output and FFN down projections zeroed, so they start as the identity).

    python benchmarks/eagle3_aux_experiment.py --init src/treedraft/heads/smollm2-135m-instruct \
        --data /work/eagle-s13/data --eval /work/eagle-s13/mtb --out /work/s14/aux-run [--no-aux]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

import treedraft
from treedraft.drafters.eagle import EagleNet
from treedraft.models.llama import Block, RMSNorm
from treedraft.training.eagle_train import (
    batch_loss,
    collate,
    evaluate,
    load_eagle_shards,
    make_batches,
    sequence_spans,
    split_spans,
)


class AuxFusion(nn.Module):
    """f + W [norm_a(a); norm_b(b)], W (H, 2H) zero at init."""

    def __init__(self, hidden: int, n: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(hidden, eps) for _ in range(n))
        self.proj = nn.Linear(n * hidden, hidden, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, feat: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        parts = aux.float().split(feat.shape[-1], -1)
        return feat + self.proj(torch.cat([nrm(p) for nrm, p in zip(self.norms, parts)], -1))


def load_aux(d: str) -> torch.Tensor:
    """(N, n*H) fp16 aux features in shard order."""
    files = sorted(Path(d).glob("shard_*.safetensors"))
    out = []
    for f in files:
        a = load_file(str(f).replace("shard_", "aux_"))
        out.append(torch.cat([a[k] for k in sorted(a, key=lambda k: int(k[5:]))], -1))
    return torch.cat(out)


def with_aux(data: dict, aux: torch.Tensor | None, batch: list, fusion: AuxFusion | None) -> dict:
    b = collate(data, batch)
    if fusion is not None:
        T = b["feat"].shape[1]
        a = torch.zeros(len(batch), T, aux.shape[1])
        for i, (s, e) in enumerate(batch):
            a[i, : e - s] = aux[s:e].float()
        b["feat"] = fusion(b["feat"], a)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-aux", action="store_true")
    ap.add_argument("--extra-layers", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--aux-lr", type=float, default=None, help="lr of the fusion (default --lr)")
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--ce-weight", type=float, default=0.5)
    ap.add_argument("--tokens-per-batch", type=int, default=256)
    ap.add_argument("--max-batches", type=int, default=0, help="stop the epoch early (0 = whole epoch)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    llm = treedraft.load(drafter=None, weights="int4")
    net = EagleNet.load(a.init, llm.model, llm.model_name).requires_grad_(True)
    data, ev = load_eagle_shards(a.data), load_eagle_shards(a.eval)
    aux = ev_aux = fusion = None
    if not a.no_aux:
        aux, ev_aux = load_aux(a.data), load_aux(a.eval)
        assert len(aux) == len(data["seq"]) and len(ev_aux) == len(ev["seq"])
        fusion = AuxFusion(net.config.hidden_size, aux.shape[1] // net.config.hidden_size, net.config.rms_eps)
    blocks = [net.layer]
    for _ in range(a.extra_layers):
        blk = Block(net.config.llama(), 0)
        blk.load_state_dict(net.layer.state_dict())
        with torch.no_grad():
            blk.attn.wo.weight.zero_()
            blk.ffn.w2.weight.zero_()
        blocks.append(blk.train())
    train, held = split_spans(sequence_spans(data["seq"]), 0.1)
    ev_spans = sequence_spans(ev["seq"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.jsonl", "a")

    def top1(d: dict, x: torch.Tensor | None, spans: list) -> list[float]:
        acc = evaluate(net, d, spans, 4, 256, lambda dd, batch: with_aux(dd, x, batch, fusion), blocks)
        return [round(v, 4) for v in acc]

    def report(tag: str) -> None:
        net.eval()
        r = {
            "tag": tag,
            "eval_top1": top1(ev, ev_aux, ev_spans),
            "heldout_top1": top1(data, aux, held[:80]),
        }
        print(json.dumps(r), flush=True)
        log.write(json.dumps(r) + "\n")
        log.flush()

    report("start")
    batches = make_batches(train, a.tokens_per_batch)
    order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(0)).tolist()
    if a.max_batches:
        order = order[: a.max_batches]
    groups = [{"params": list(net.parameters()) + [p for b in blocks[1:] for p in b.parameters()], "lr": a.lr}]
    if fusion is not None:
        groups.append({"params": list(fusion.parameters()), "lr": a.aux_lr or a.lr})
    for g in groups:
        g["base"] = g["lr"]
    opt = torch.optim.AdamW(groups, weight_decay=0.0, betas=(0.9, 0.95))
    params = [p for g in groups for p in g["params"]]
    t0 = time.time()
    for step, bi in enumerate(order):
        f = (step + 1) / 20 if step < 20 else 0.5 * (1 + math.cos(math.pi * step / len(order)))
        for g in opt.param_groups:
            g["lr"] = g["base"] * f
        net.train()
        loss, stats = batch_loss(net, with_aux(data, aux, batches[bi], fusion), a.unroll, a.ce_weight, blocks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if step % 200 == 0:
            w = 0.0 if fusion is None else float(fusion.proj.weight.norm())
            print(
                f"step {step}/{len(order)} loss {float(loss):.4f} ce1 {stats['ce1']:.3f} |W| {w:.3f} "
                f"{time.time() - t0:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    report("end")
    torch.save(
        {
            "net": net.state_dict(),
            "fusion": None if fusion is None else fusion.state_dict(),
            "extra_layers": [b.state_dict() for b in blocks[1:]],
        },
        out / "final.pt",
    )


if __name__ == "__main__":
    main()

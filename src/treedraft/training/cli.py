"""`treedraft train-heads` and `treedraft calibrate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _default_prompts() -> str:
    for cand in (Path("../shared/data/sharegpt_prompts.jsonl"), Path(__file__).resolve().parents[3].parent
                 / "shared" / "data" / "sharegpt_prompts.jsonl"):
        if cand.is_file():
            return str(cand)
    return "sharegpt_prompts.jsonl"


def _default_eval() -> str | None:
    p = Path(_default_prompts()).with_name("mt_bench_questions.jsonl")
    return str(p) if p.is_file() else None


def register(sub: argparse._SubParsersAction) -> None:
    """Add train-heads and calibrate subcommands."""
    from ..cli import add_model_args

    t = sub.add_parser("train-heads", help="self-distil Medusa heads for a model")
    add_model_args(t)
    t.add_argument("--prompts", default=_default_prompts(), help="jsonl with {'prompt'} or {'turns'} records")
    t.add_argument("--num-prompts", type=int, default=1280)
    t.add_argument("--eval-prompts", default=_default_eval(), help="held-out jsonl for accuracy (MT-Bench)")
    t.add_argument("--max-new-tokens", type=int, default=192)
    t.add_argument("--gen-batch-size", type=int, default=16)
    t.add_argument("--data-dir", default="data-cache", help="where generated answers are cached (resumable)")
    t.add_argument("--out", required=True, help="output directory for the heads")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--num-layers", type=int, default=1)
    t.add_argument("--projection", choices=("shared", "separate"), default="shared",
                   help="shared: the base model's frozen lm_head; separate: one trainable projection per head")
    t.add_argument("--draft-vocab", type=int, default=16384,
                   help="heads score only the N most frequent answer tokens (0 = full vocabulary)")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("calibrate", help="choose the tree for this machine from head accuracy and latency")
    add_model_args(c)
    c.add_argument("--eval-data", default="data-cache/mtbench", help="answers directory from train-heads")
    c.add_argument("--max-nodes", type=int, default=64)
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--check-prompts", type=int, default=4, help="MT-Bench prompts to measure the chosen tree on")
    c.add_argument("--write", action="store_true", help="store the chosen tree in the heads' medusa.json")
    c.set_defaults(func=cmd_calibrate)


def cmd_train(a: argparse.Namespace) -> int:
    """Generate (cached) self-distillation data, train heads, evaluate, save."""
    import torch

    from .. import load
    from ..drafters.medusa import MedusaConfig
    from .data import generate_dataset, load_shards, read_prompts
    from .train import TrainConfig, evaluate, head_targets, train_heads

    if a.threads:
        torch.set_num_threads(a.threads)
    llm = load(a.model, drafter=None, device=a.device, dtype=a.dtype, runtime=a.runtime)
    prompts = read_prompts(a.prompts)[: a.num_prompts]
    data = Path(a.data_dir)
    train_dir = generate_dataset(llm, prompts, data / f"{Path(a.prompts).stem}-{a.num_prompts}",
                                 a.max_new_tokens, a.gen_batch_size)
    eval_dir = (generate_dataset(llm, read_prompts(a.eval_prompts), data / "mtbench", 256, a.gen_batch_size)
                if a.eval_prompts else None)
    lm = llm.model.lm_head.weight
    mcfg = MedusaConfig(base_model=llm.model_name, hidden_size=llm.model.hidden_size,
                        vocab_size=llm.model.vocab_size, num_heads=a.num_heads, num_layers=a.num_layers,
                        shared_lm_head=a.projection == "shared", draft_vocab=a.draft_vocab)
    tcfg = TrainConfig(epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    heads, report = train_heads(train_dir, lm, mcfg, tcfg, Path(a.out) / "ckpt")
    if eval_dir is not None:
        tok, hid, seq = load_shards(eval_dir)
        report["mt_bench"] = evaluate(heads, hid, head_targets(tok, seq, a.num_heads))
    from dataclasses import replace
    heads.config = replace(heads.config, extra={**heads.config.extra, "training": report,
                                                 "prompts": a.prompts, "num_prompts": a.num_prompts})
    heads.save(a.out)
    print(json.dumps(report, indent=1))
    return 0


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Measure latency and head accuracy here; pick and optionally store the tree."""
    from .. import load
    from ..drafters.medusa import MedusaDrafter
    from .calibrate import choose_tree, measure_latency
    from .data import load_shards, read_prompts
    from .train import head_targets, rank_accuracy

    llm = load(a.model, drafter="medusa", heads=a.heads, device=a.device, dtype=a.dtype, runtime=a.runtime)
    drafter = llm.engine.drafter
    heads = drafter.heads
    tok, hid, seq = load_shards(a.eval_data)
    acc = rank_accuracy(heads, hid.float(), head_targets(tok, seq, heads.config.num_heads))
    lat = measure_latency(llm.model, a.context)
    import time

    import torch
    h = torch.randn(llm.model.hidden_size)
    t = time.perf_counter()
    for _ in range(10):
        heads(h)
    draft_cost = (time.perf_counter() - t) / 10
    res = choose_tree(acc, lat, draft_cost, a.max_nodes)
    print(f"latency (s) per forward of n tokens on a {a.context}-token cache: "
          + ", ".join(f"{n}:{v * 1000:.1f}ms" for n, v in lat.items()))
    print(f"draft cost {draft_cost * 1000:.1f} ms; chosen tree: {res['nodes']} draft nodes, expected mean accepted "
          f"length {res['expected_len']:.2f}, expected {res['expected_tok_per_s']:.1f} tok/s "
          f"(plain {res['plain_tok_per_s']:.1f} tok/s)")
    measured = {}
    if a.check_prompts:
        qs = read_prompts(_default_eval() or a.eval_data)[: a.check_prompts]
        d = MedusaDrafter(heads, tuple(tuple(c) for c in res["choices"]))
        tot_t = tot_n = steps = acc_len = 0.0
        for q in qs:
            r = llm.generate(q, drafter=d, max_new_tokens=128)
            tot_t += r.stats.t_decode
            tot_n += r.stats.new_tokens
            steps += len(r.stats.steps)
            acc_len += sum(s.accepted + 1 for s in r.stats.steps)
        measured = {"mean_accepted_length": acc_len / max(1, steps), "tok_per_s": tot_n / max(tot_t, 1e-9)}
        print(f"measured on {len(qs)} MT-Bench prompts: mean accepted length {measured['mean_accepted_length']:.2f}, "
              f"{measured['tok_per_s']:.1f} tok/s")
    if a.write:
        d = Path(a.heads) if a.heads not in (None, "default") else None
        if d is None:
            from ..drafters.medusa import shipped_heads_for
            d = shipped_heads_for(llm.model_name)
        cfg_path = d / "medusa.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["choices"] = res["choices"]
        cfg.setdefault("extra", {})["calibration"] = {
            "latency_ms": {str(k): round(v * 1000, 2) for k, v in lat.items()}, "rank_accuracy": acc,
            "draft_cost_ms": round(draft_cost * 1000, 2), "expected_len": res["expected_len"],
            "expected_tok_per_s": res["expected_tok_per_s"], "measured": measured}
        cfg_path.write_text(json.dumps(cfg, indent=1))
        print(f"wrote tree to {cfg_path}", file=sys.stderr)
    return 0

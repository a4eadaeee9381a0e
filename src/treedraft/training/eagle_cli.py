"""`treedraft train-eagle`: self-distillation data (with prompt positions) -> EAGLE drafter."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..prompts import FORMATS, SHARED_DATA, SHAREGPT_FILE, first_prompts


def register(sub: argparse._SubParsersAction) -> None:
    """Add the train-eagle subcommand."""
    from ..cli import add_model_args
    from .cli import MAX_PROMPT_TOKENS, _default_prompts
    from .eagle_train import EagleTrainConfig

    d = EagleTrainConfig()
    t = sub.add_parser("train-eagle", help="self-distil an EAGLE drafter (one decoder layer) for a model")
    add_model_args(t, drafting=False, heads=False)
    t.add_argument(
        "--prompts",
        default=_default_prompts(),
        help=f"jsonl of prompts: {FORMATS} (default: {SHARED_DATA / SHAREGPT_FILE} when present)",
    )
    t.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the file (default: all)")
    t.add_argument("--max-new-tokens", type=int, default=256)
    t.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS, help="longer prompts are skipped")
    t.add_argument("--gen-concurrency", type=int, default=8, help="requests answered together by the batched scheduler")
    t.add_argument("--shard-size", type=int, default=32, help="prompts per data shard (the unit of resuming)")
    t.add_argument(
        "--gen-temperature",
        type=float,
        default=0.0,
        help="sample the answers at this temperature (0 = greedy): more varied contexts, e.g. as --extra-train-data",
    )
    t.add_argument("--gen-seed", type=int, default=0, help="with --gen-temperature: prompt i is drawn with seed + i")
    t.add_argument(
        "--extra-train-data",
        action="append",
        default=[],
        metavar="DIR",
        help="more shard directories, for training only: sampled answers to the same prompts (their answers to "
        "--train-data's held-out prompts, matched by index, are left out) or answers to other prompts (repeatable)",
    )
    t.add_argument(
        "--train-data",
        default=None,
        help="data directory (resumable; default: data-cache/<model>--<prompts>-<n>-new<N>-prompt<N>-eagle)",
    )
    t.add_argument("--no-generate", action="store_true", help="train on the shards already in --train-data")
    t.add_argument(
        "--max-shards", type=int, default=None, help="generate and train on only the first N shards (default: all)"
    )
    t.add_argument("--gen-only", action="store_true", help="stop after the data step (no --out needed)")
    t.add_argument("--out", default=None, help="output directory (eagle.json + eagle.safetensors, fp16)")
    t.add_argument("--draft-vocab", type=int, default=16384, help="score only the N most frequent tokens (0 = all)")
    t.add_argument("--epochs", type=int, default=d.epochs)
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    t.add_argument("--ce-weight", type=float, default=d.ce_weight, help="token cross-entropy weight (EAGLE-1: 0.1)")
    t.add_argument("--unroll", type=int, default=d.unroll, help="training passes feeding own features (1 = EAGLE-1)")
    t.add_argument("--eval-unroll", type=int, default=d.eval_unroll, help="depths measured on the held-out split")
    t.add_argument("--heldout", type=float, default=d.heldout, help="fraction of sequences held out")
    t.add_argument("--init-from-target", action="store_true", help="start the layer as the target's last layer")
    t.add_argument("--init-from", default=None, help="start from an earlier drafter directory's weights")
    t.add_argument("--depth", type=int, default=6, help="tree depth stored with the drafter")
    t.add_argument("--topk", type=int, default=8, help="tree branching stored with the drafter")
    t.add_argument("--nodes", type=int, default=0, help="draft nodes per tree stored with the drafter (0 = budget)")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    t.set_defaults(func=cmd_train_eagle)


def validate(a: argparse.Namespace) -> None:
    """Argument checks that need no model (ValueError naming the option)."""
    from .cli import _check, check_at_least, check_extra_train_data, check_out_dir
    from .data import has_shards

    _check(a.prompts is not None or a.no_generate, "no prompt file found; pass --prompts FILE")
    _check(a.no_generate or Path(a.prompts).is_file(), f"--prompts {a.prompts}: no such file")
    check_at_least(
        (
            ("--max-new-tokens", a.max_new_tokens, 1),
            ("--max-prompt-tokens", a.max_prompt_tokens, 1),
            ("--gen-concurrency", a.gen_concurrency, 1),
            ("--shard-size", a.shard_size, 1),
            ("--draft-vocab", a.draft_vocab, 0),
            ("--epochs", a.epochs, 1),
            ("--tokens-per-batch", a.tokens_per_batch, 16),
            ("--unroll", a.unroll, 1),
            ("--eval-unroll", a.eval_unroll, 1),
            ("--depth", a.depth, 1),
            ("--topk", a.topk, 1),
            ("--nodes", a.nodes, 0),
            ("--threads", a.threads, 0),
        )
    )
    _check(a.max_shards is None or a.max_shards >= 1, f"--max-shards must be >= 1, got {a.max_shards}")
    _check(a.out is not None or a.gen_only, "--out DIR is required (unless --gen-only)")
    _check(not (a.gen_only and a.no_generate), "--gen-only and --no-generate exclude each other")
    _check(a.num_prompts is None or a.num_prompts >= 1, f"--num-prompts must be >= 1, got {a.num_prompts}")
    _check(a.lr > 0 and a.ce_weight >= 0, "--lr must be > 0 and --ce-weight >= 0")
    _check(0 <= a.heldout < 0.5, f"--heldout must be in [0, 0.5), got {a.heldout}")
    _check(a.gen_temperature >= 0, f"--gen-temperature must be >= 0, got {a.gen_temperature}")
    if a.gen_seed != 0 and a.gen_temperature == 0 and not a.no_generate:  # said, as generate says an idle --seed
        print("note: --gen-seed seeds sampled answers; at --gen-temperature 0 they are greedy", file=sys.stderr)
    _check(
        not (a.init_from and a.init_from_target),
        "--init-from and --init-from-target both set the starting weights; give one",
    )
    _check(  # before the model load and the data step (hours), not after them
        a.init_from is None or (Path(a.init_from) / "eagle.json").is_file(),
        f"--init-from {a.init_from}: no eagle.json there; give a directory `treedraft train-eagle` wrote",
    )
    check_extra_train_data(a.extra_train_data)
    check_out_dir(a.out)
    _check(
        not a.no_generate or (a.train_data and has_shards(a.train_data)),
        "--no-generate needs --train-data DIR holding shard_*.safetensors",
    )


def cmd_train_eagle(a: argparse.Namespace) -> int:
    """Generate (cached, resumable) data with the serving weights, train, evaluate, save fp16."""
    import torch

    from .. import load
    from ..cli import model_kwargs
    from ..drafters.eagle import EagleConfig
    from .cli import _check, cache_name, check_data_model
    from .data import model_identity, read_prompts
    from .eagle_data import generate_eagle_dataset
    from .eagle_train import EagleTrainConfig, train_eagle, write_report

    validate(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    llm = load(a.model, drafter=None, **model_kwargs(a))
    _check(a.draft_vocab <= llm.model.vocab_size, f"--draft-vocab must be <= {llm.model.vocab_size}")
    # the data directories given are checked before any generation (hours, for all the prompts)
    given = [*([a.train_data] if a.train_data and Path(a.train_data).is_dir() else []), *a.extra_train_data]
    check_data_model(model_identity(llm), given)
    # (extra data over other prompt files is fine: the shipped recipe adds template and self-written requests)
    if a.no_generate:
        data = Path(a.train_data)
    else:
        every = read_prompts(a.prompts)
        prompts = first_prompts(every, a.num_prompts, a.prompts)
        n = None if a.num_prompts is None else min(a.num_prompts, len(every))  # (more than the file: as many as it has)
        name = cache_name(llm.model_name, a.prompts, n, a.max_new_tokens, a.max_prompt_tokens)
        sampled = f"-t{a.gen_temperature:g}-s{a.gen_seed}" if a.gen_temperature > 0 else ""
        data = Path(a.train_data) if a.train_data else Path("data-cache") / f"{name}-eagle{sampled}"
        # features from the serving loop and weights: bitwise what the drafter reads at inference
        generate_eagle_dataset(
            llm,
            prompts,
            data,
            max_new_tokens=a.max_new_tokens,
            concurrency=a.gen_concurrency,
            max_prompt_tokens=a.max_prompt_tokens,
            shard_size=a.shard_size,
            prompt_file=a.prompts,
            max_shards=a.max_shards,
            temperature=a.gen_temperature,
            seed=a.gen_seed,
        )
    t_data = time.perf_counter() - t0
    if a.gen_only:
        print(f"data in {data} ({t_data:.0f} s)")
        return 0
    cfg = EagleConfig.for_target(
        llm.model, llm.model_name, draft_vocab=a.draft_vocab, depth=a.depth, topk=a.topk, nodes=a.nodes
    )
    tcfg = EagleTrainConfig(
        epochs=a.epochs,
        lr=a.lr,
        tokens_per_batch=a.tokens_per_batch,
        ce_weight=a.ce_weight,
        unroll=a.unroll,
        eval_unroll=a.eval_unroll,
        heldout=a.heldout,
        seed=a.seed,
    )
    out = Path(a.out)
    net, report = train_eagle(
        data,
        llm.model,
        cfg,
        tcfg,
        out / "ckpt",
        init_from_target=a.init_from_target,
        init_from=a.init_from,
        max_shards=a.max_shards,
        extra_data=a.extra_train_data,
    )
    meta_file = data / "meta.json"
    report.update(
        data=str(data),
        data_meta=json.loads(meta_file.read_text()) if meta_file.is_file() else None,
        weights=getattr(llm.model, "weights_info", None) and str(a.weights),
        train_config=tcfg.__dict__,
        init_from_target=a.init_from_target,
        init_from=a.init_from,
        data_seconds=round(t_data, 1),
        max_shards=a.max_shards,
        extra_train_data=a.extra_train_data,
    )
    from dataclasses import replace

    net.config = replace(net.config, extra={"training": {k: v for k, v in report.items() if k != "data_meta"}})
    net.save(out, dtype=torch.float16)
    write_report(out, report)
    print(json.dumps(report["epochs"][-1] if report["epochs"] else report, indent=1))
    return 0

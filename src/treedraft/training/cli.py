"""`treedraft train-heads` and `treedraft calibrate`."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..prompts import FORMATS, MT_BENCH_FILE, SHARED_DATA, SHAREGPT_FILE, find_shared_data, first_prompts


def _default_prompts() -> str | None:
    p = find_shared_data(SHAREGPT_FILE)
    return str(p) if p else None


def _default_eval() -> str | None:
    p = find_shared_data(MT_BENCH_FILE)
    return str(p) if p else None


def cache_name(
    model_name: str, prompt_file: str | Path, num_prompts: int | None, max_new_tokens: int, max_prompt_tokens: int
) -> str:
    """Data directory name: model, prompt file, prompt count and token limits (meta.json has the rest)."""
    m = Path(model_name)
    model = m.stem if m.suffix == ".gguf" else m.name
    n = "all" if num_prompts is None else str(num_prompts)
    name = f"{model}--{Path(prompt_file).stem}-{n}-new{max_new_tokens}-prompt{max_prompt_tokens}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


EVAL_MAX_NEW_TOKENS = 256
MAX_PROMPT_TOKENS = 384


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_at_least(limits: tuple[tuple[str, float, float], ...]) -> None:
    """ValueError naming the first (flag, value, lower bound) whose value is below its bound."""
    for flag, v, lo in limits:
        _check(v >= lo, f"{flag} must be >= {lo}, got {v}")


# train-heads' flags that set the heads' shape, and their defaults (refused with --init-from, which brings its own)
_SHAPE_DEFAULTS = {
    "num_heads": 4,
    "num_layers": 1,
    "projection": "shared",
    "draft_vocab": 16384,
    "root_conditioned": True,
}


def check_data_model(ident: dict, dirs: list) -> None:
    """Each data directory holds the answers of the model ``ident`` names (:func:`.data.model_identity`): its weights'
    file where both record one (a name spelled another way is the same model), else its name; a directory that
    records neither is taken as it is. Another model's answers would train or measure the wrong thing silently."""
    from .data import read_meta

    for d in dirs:
        meta = read_meta(d)
        key = "model_file" if "model_file" in meta and "model_file" in ident else "model"
        if key in meta and meta[key] != ident.get(key):
            raise ValueError(
                f"{d} holds the answers of model {meta.get('model')!r} ({meta[key]}), not of {ident.get('model')!r} "
                f"({ident.get(key)}); use this model's data"
            )


def check_out_dir(out: str | None) -> None:
    """--out, checked before any generation or training: a directory, or a path that can become one."""
    if out is None:
        return
    p = Path(out)
    _check(not p.exists() or p.is_dir(), f"--out {out} is a file; give a directory (it is created if missing)")
    parent = next((q for q in p.absolute().parents if q.exists()), None)
    _check(parent is None or parent.is_dir(), f"--out {out}: {parent} is a file, so no directory can be made there")


def check_extra_train_data(dirs: list[str]) -> None:
    """--extra-train-data (train-heads, train-eagle): each directory must hold shards."""
    from .data import has_shards

    for d in dirs:
        _check(has_shards(d), f"--extra-train-data {d}: no shard_*.safetensors there")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the train-heads, calibrate, train-eagle and synth-prompts subcommands."""
    from ..cli import add_model_args

    t = sub.add_parser("train-heads", help="self-distil Medusa heads for a model")
    add_model_args(t, drafting=False, heads=False)
    t.add_argument(
        "--prompts",
        default=_default_prompts(),
        help=f"jsonl of prompts: {FORMATS} (default: {SHARED_DATA / SHAREGPT_FILE} when present)",
    )
    t.add_argument(
        "--num-prompts", type=int, default=None, help=f"the first N prompts of --prompts (default {NUM_PROMPTS})"
    )
    t.add_argument(
        "--eval-prompts",
        default=_default_eval(),
        help=f"held-out jsonl for accuracy (default: {SHARED_DATA / MT_BENCH_FILE} when present)",
    )
    t.add_argument("--max-new-tokens", type=int, default=192)
    t.add_argument("--eval-max-new-tokens", type=int, default=EVAL_MAX_NEW_TOKENS)
    t.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=MAX_PROMPT_TOKENS,
        help="prompts longer than this (after the chat template) are skipped",
    )
    t.add_argument("--gen-batch-size", type=int, default=16)
    t.add_argument(
        "--data-dir",
        default="data-cache",
        help="where generated answers are cached (resumable), in subdirectories named after the model, "
        "prompt file and token limits",
    )
    t.add_argument("--train-data", default=None, help="use this directory for the training answers instead")
    t.add_argument(
        "--no-generate",
        action="store_true",
        help="train on the shards already in --train-data (e.g. an interrupted run); generate nothing (no "
        "evaluation either unless --eval-data holds answers)",
    )
    t.add_argument(
        "--extra-train-data",
        action="append",
        default=[],
        metavar="DIR",
        help="more shard directories to train on (e.g. train-eagle's data: its answer rows are used; repeatable)",
    )
    t.add_argument(
        "--eval-data",
        default=None,
        help="use this directory for the evaluation answers instead (with --no-generate: as it is, e.g. "
        "train-eagle's data for the --eval-prompts)",
    )
    t.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="start from these heads (their shape and draft vocabulary; --num-heads, --num-layers, --projection, "
        "--draft-vocab, --root-conditioned are then theirs)",
    )
    t.add_argument("--out", required=True, help="output directory for the heads")
    t.add_argument("--num-heads", type=int, default=_SHAPE_DEFAULTS["num_heads"])
    t.add_argument("--num-layers", type=int, default=_SHAPE_DEFAULTS["num_layers"])
    t.add_argument(
        "--root-conditioned",
        action=argparse.BooleanOptionalAction,
        default=_SHAPE_DEFAULTS["root_conditioned"],
        help="heads also read the root token's embedding (measured: +37%% head-0 top-1 on MT-Bench)",
    )
    t.add_argument(
        "--projection",
        choices=("shared", "separate"),
        default=_SHAPE_DEFAULTS["projection"],
        help="shared: the base model's frozen lm_head; separate: one trainable projection per head",
    )
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=_SHAPE_DEFAULTS["draft_vocab"],
        help="heads score only the N most frequent answer tokens (0 = full vocabulary)",
    )
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=256)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser("calibrate", help="choose the tree for this machine from head accuracy and latency")
    add_model_args(
        c,
        drafting=False,
        heads_help="Medusa heads directory (medusa.json, from train-heads) whose tree to choose (default: the shipped "
        "ones); an EAGLE drafter sizes its trees itself as it drafts",
    )
    c.add_argument(
        "--eval-data",
        default=None,
        help="answers directory from train-heads (default: data-cache/<model>--mt_bench_questions-all-"
        f"new{EVAL_MAX_NEW_TOKENS}-prompt{MAX_PROMPT_TOKENS})",
    )
    c.add_argument(
        "--max-nodes",
        type=int,
        default=64,
        help="tree size budget, root included (like --max-tree-nodes): at most N-1 draft nodes",
    )
    c.add_argument(
        "--context", type=int, default=512, help="KV cache length the forward latency is measured at (default 512)"
    )
    c.add_argument("--check-prompts", type=int, default=4, help="MT-Bench prompts to measure the chosen tree on")
    c.add_argument(
        "--check-file",
        default=_default_eval(),
        help=f"prompts for the measured check (default: {SHARED_DATA / MT_BENCH_FILE} when present)",
    )
    c.add_argument(
        "--write",
        action="store_true",
        help="store the chosen tree for this machine in the user cache (where drafters look first)",
    )
    c.set_defaults(func=cmd_calibrate)
    from .eagle_cli import register as register_eagle
    from .synth import register as register_synth

    register_eagle(sub)
    register_synth(sub)


NUM_PROMPTS = 1280  # train-heads' prompts when --num-prompts is not given


def _not_a_file(path) -> str:
    """Why ``path`` is no file to read: it is a directory, or it does not exist."""
    return "a directory; give a prompt file (jsonl)" if Path(path).is_dir() else "no such file"


def validate_train_args(a: argparse.Namespace) -> None:
    """Argument checks that need no model (ValueError with the option to change)."""
    if not getattr(a, "no_generate", False):  # (--no-generate trains on --train-data: no prompt is read)
        _check(
            a.prompts is not None, f"no prompt file: {SHARED_DATA / SHAREGPT_FILE} was not found; pass --prompts FILE"
        )
        _check(Path(a.prompts).is_file(), f"--prompts {a.prompts}: {_not_a_file(a.prompts)}")
    _check(
        a.eval_prompts is None or Path(a.eval_prompts).is_file(),
        f"--eval-prompts {a.eval_prompts}: {_not_a_file(a.eval_prompts)}",
    )
    if not hasattr(a, "num_prompts_given"):  # (once: a second call would take the default for a given value)
        a.num_prompts_given = a.num_prompts is not None  # (a warning about a flag never passed confused a review)
    if a.num_prompts is None:
        a.num_prompts = NUM_PROMPTS
    check_at_least(
        (
            ("--num-prompts", a.num_prompts, 1),
            ("--max-new-tokens", a.max_new_tokens, 1),
            ("--eval-max-new-tokens", a.eval_max_new_tokens, 1),
            ("--max-prompt-tokens", a.max_prompt_tokens, 1),
            ("--gen-batch-size", a.gen_batch_size, 1),
            ("--num-heads", a.num_heads, 1),
            ("--num-layers", a.num_layers, 1),
            ("--draft-vocab", a.draft_vocab, 0),
            ("--epochs", a.epochs, 1),
            ("--batch-size", a.batch_size, 1),
            ("--threads", a.threads, 0),
        )
    )
    _check(a.lr > 0, f"--lr must be > 0, got {a.lr}")
    check_extra_train_data(a.extra_train_data)
    check_out_dir(a.out)
    if a.init_from is not None:
        given = ["--" + k.replace("_", "-") for k, v in _SHAPE_DEFAULTS.items() if getattr(a, k) != v]
        _check(not given, f"{', '.join(given)}: the heads' shape comes from --init-from {a.init_from}; drop it")
    _check(
        a.init_from is None or (Path(a.init_from) / "medusa.json").is_file(),
        f"--init-from {a.init_from}: no medusa.json there (a directory written by train-heads)",
    )


def cmd_train(a: argparse.Namespace) -> int:
    """Generate (cached) self-distillation data, train heads, evaluate, save."""
    from dataclasses import replace

    import torch

    from .. import load
    from ..cli import model_kwargs
    from ..drafters.medusa import MedusaConfig
    from .data import generate_dataset, has_shards, load_shards, model_identity, read_meta, read_prompts
    from .train import TrainConfig, evaluate, head_targets, rank_accuracy, train_heads

    validate_train_args(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = load(a.model, drafter=None, **model_kwargs(a))
    vocab = llm.model.vocab_size
    _check(a.draft_vocab <= vocab, f"--draft-vocab must be <= the model's vocabulary ({vocab}), got {a.draft_vocab}")
    prompts = (  # (--no-generate: read none; --train-data is the data)
        []
        if a.no_generate
        else first_prompts(read_prompts(a.prompts), a.num_prompts, a.prompts, warn=a.num_prompts_given)
    )
    data = Path(a.data_dir)
    train_dir = (
        Path(a.train_data)
        if a.train_data
        else None
        if a.no_generate  # (refused just below)
        else data / cache_name(llm.model_name, a.prompts, len(prompts), a.max_new_tokens, a.max_prompt_tokens)
    )
    if a.no_generate:
        _check(
            a.train_data is not None and has_shards(a.train_data),
            "--no-generate needs --train-data DIR holding shard_*.safetensors from an earlier run",
        )
    else:
        train_dir = generate_dataset(
            llm,
            prompts,
            train_dir,
            max_new_tokens=a.max_new_tokens,
            batch_size=a.gen_batch_size,
            max_prompt_tokens=a.max_prompt_tokens,
            prompt_file=a.prompts,
        )
    eval_dir = None
    if a.no_generate and a.eval_data:
        _check(has_shards(a.eval_data), f"--eval-data {a.eval_data}: no shards there")
        eval_dir = Path(a.eval_data)
    elif a.no_generate:  # generate nothing: evaluating would mean answering --eval-prompts first
        print(
            "warning: --no-generate without --eval-data: no evaluation, so the heads record no rank accuracies "
            "(machines then use the default tree); pass --eval-data DIR (answers to held-out prompts, e.g. "
            "`treedraft train-eagle --gen-only --prompts FILE --train-data DIR`) to evaluate them",
            file=sys.stderr,
        )
    elif a.eval_prompts:
        eval_dir = (
            Path(a.eval_data)
            if a.eval_data
            else data / cache_name(llm.model_name, a.eval_prompts, None, a.eval_max_new_tokens, a.max_prompt_tokens)
        )
        eval_dir = generate_dataset(
            llm,
            read_prompts(a.eval_prompts),
            eval_dir,
            max_new_tokens=a.eval_max_new_tokens,
            batch_size=a.gen_batch_size,
            max_prompt_tokens=a.max_prompt_tokens,
            prompt_file=a.eval_prompts,
        )
    lm = llm.model.output_projection_weight()
    check_data_model(model_identity(llm), [train_dir, *a.extra_train_data, *([eval_dir] if eval_dir else [])])
    for d in [train_dir, *a.extra_train_data]:  # sampled answers
        meta = read_meta(d)
        if meta.get("temperature", 0) > 0:
            print(
                f"warning: {d} holds sampled answers (temperature {meta['temperature']}): the heads learn to "
                "predict sampled tokens there, not the greedy ones they draft for",
                file=sys.stderr,
            )
    init = None
    if a.init_from:
        from ..drafters.medusa import MedusaHeads

        init = MedusaHeads.load(
            a.init_from, lm, llm.model_name, llm.model.hidden_size, vocab, llm.model.input_embedding_weight()
        )
        mcfg = replace(init.config, extra={}, choices=())  # a fixed tree was chosen for the old accuracies
    else:
        mcfg = MedusaConfig(
            base_model=llm.model_name,
            hidden_size=llm.model.hidden_size,
            vocab_size=vocab,
            num_heads=a.num_heads,
            num_layers=a.num_layers,
            shared_lm_head=a.projection == "shared",
            draft_vocab=a.draft_vocab,
            root_conditioned=a.root_conditioned,
        )
    tcfg = TrainConfig(epochs=a.epochs, lr=a.lr, batch_size=a.batch_size, seed=a.seed)
    heads, report = train_heads(
        [train_dir, *a.extra_train_data],
        lm,
        mcfg,
        tcfg,
        Path(a.out) / "ckpt",
        embed_weight=llm.model.input_embedding_weight(),
        init=init,
    )
    acc_extra = {}
    if eval_dir is not None:
        tok, hid, seq = load_shards(eval_dir)
        targets = head_targets(tok, seq, heads.config.num_heads)
        # (the key keeps its old name, read from shipped files; "eval_prompts" below says which prompts it measured)
        report["mt_bench"] = evaluate(heads, hid, targets, roots=tok)
        report["eval_prompts"] = str(a.eval_data or a.eval_prompts)
        # what each machine builds its tree from at first use (training/calibrate.machine_tree)
        acc_extra = {
            "rank_accuracy": rank_accuracy(heads, hid.float(), targets, roots=tok),
            "rank_accuracy_data": str(eval_dir),
        }
    heads.config = replace(
        heads.config,
        extra={
            **heads.config.extra,
            "training": report,
            # (with --no-generate the data's own meta.json says what it was made from, not these flags)
            "prompts": None if getattr(a, "no_generate", False) else a.prompts,
            "num_prompts": None if getattr(a, "no_generate", False) else a.num_prompts,
            "train_data": str(train_dir),
            **({"extra_train_data": list(a.extra_train_data)} if a.extra_train_data else {}),
            **({"init_from": str(a.init_from)} if a.init_from else {}),
            "eval_data": str(eval_dir) if eval_dir else None,
            **acc_extra,
        },
    )
    heads.save(a.out)
    print(json.dumps(report, indent=1))
    return 0


def validate_calibrate_args(a: argparse.Namespace) -> None:
    """Argument checks that need no model (ValueError with the option to change)."""
    _check(a.max_nodes >= 1, f"--max-nodes counts the root and must be >= 1, got {a.max_nodes}")
    _check(a.context >= 1, f"--context must be >= 1, got {a.context}")
    _check(a.check_prompts >= 0, f"--check-prompts must be >= 0, got {a.check_prompts}")
    heads = Path(a.heads) if a.heads not in (None, "default") else None
    _check(
        heads is None or (heads / "medusa.json").is_file() or not (heads / "eagle.json").is_file(),
        f"--heads {a.heads}: an EAGLE drafter (eagle.json), and calibrate chooses a Medusa tree only (medusa.json, "
        "from train-heads); an EAGLE drafter sizes its trees itself as it drafts, nothing to calibrate",
    )
    if a.check_prompts:
        _check(
            a.check_file is not None,
            f"the measured check needs prompts and {SHARED_DATA / MT_BENCH_FILE} was "
            "not found: pass --check-file FILE, or --check-prompts 0 to skip the check",
        )
        _check(Path(a.check_file).is_file(), f"--check-file {a.check_file}: no such file (or pass --check-prompts 0)")
        from .data import read_prompts

        read_prompts(a.check_file)  # an empty or unreadable file is said before the latency measurement
    if a.eval_data is not None:
        _check(
            Path(a.eval_data).is_dir(),
            f"--eval-data {a.eval_data}: no such directory; run `treedraft "
            "train-heads` first or point at its answers directory",
        )


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Measure latency and head accuracy here; pick and optionally store the tree."""
    import time

    import torch

    from .. import load
    from ..cli import model_kwargs
    from ..drafters.medusa import MedusaDrafter
    from ..engine import GenerationStats
    from ..interfaces import DraftContext
    from .calibrate import (
        choose_tree,
        latency_sizes,
        measure_latency,
        shipped_accuracies,
        store_machine_tree,
        tree_record,
    )
    from .data import load_shards, model_identity, read_prompts
    from .train import head_targets, rank_accuracy

    validate_calibrate_args(a)
    llm = load(a.model, drafter="medusa", heads=a.heads, **model_kwargs(a))
    max_len = getattr(llm.model, "max_seq_len", None)
    _check(
        max_len is None or a.context + a.max_nodes <= max_len,
        f"--context {a.context} + --max-nodes {a.max_nodes} exceeds the {max_len}-position cache calibrate loads "
        "the model with (the default --max-seq-len); lower --context",
    )
    eval_data = (
        Path(a.eval_data)
        if a.eval_data
        else Path("data-cache")
        / cache_name(llm.model_name, MT_BENCH_FILE, None, EVAL_MAX_NEW_TOKENS, MAX_PROMPT_TOKENS)
    )
    drafter = llm.engine.drafter
    heads = drafter.heads
    shipped = shipped_accuracies(heads.config)
    _check(
        eval_data.is_dir() or shipped is not None,
        f"no evaluation answers at {eval_data} and the heads record no rank accuracies; run `treedraft "
        "train-heads` first or pass --eval-data DIR",
    )
    if eval_data.is_dir():
        check_data_model(model_identity(llm), [eval_data])
        tok, hid, seq = load_shards(eval_data)
        acc = rank_accuracy(heads, hid.float(), head_targets(tok, seq, heads.config.num_heads), roots=tok)
    else:
        print(
            f"no evaluation answers at {eval_data}: using the rank accuracies recorded with the heads", file=sys.stderr
        )
        acc, tok, hid = shipped, None, None
    lat = measure_latency(llm.model, a.context, sizes=latency_sizes(a.max_nodes))
    p0 = next(heads.parameters())
    h0 = hid[0] if hid is not None else torch.zeros(heads.config.hidden_size)
    ctx = DraftContext([int(tok[0]) if tok is not None else 0], h0.to(device=p0.device, dtype=p0.dtype), a.max_nodes, 8)
    drafter.propose(ctx)  # warm-up
    t = time.perf_counter()
    for _ in range(10):
        drafter.propose(ctx)  # heads + top-k + tree building: the whole per-step drafting cost
    draft_cost = (time.perf_counter() - t) / 10
    res = choose_tree(acc, lat, draft_cost, a.max_nodes)
    for w in res["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(
        f"latency (s) per forward of n tokens on a {a.context}-token cache: "
        + ", ".join(f"{n}:{v * 1000:.1f}ms" for n, v in lat.items())
    )
    print(
        f"draft cost {draft_cost * 1000:.1f} ms; chosen tree: {res['nodes']} draft nodes + root "
        f"(budget {a.max_nodes} incl. root), expected mean accepted length {res['expected_len']:.2f}, "
        f"expected {res['expected_tok_per_s']:.1f} tok/s (plain {res['plain_tok_per_s']:.1f} tok/s)"
    )
    measured = {}
    if a.check_prompts:
        qs = read_prompts(a.check_file)[: a.check_prompts]
        d = MedusaDrafter(heads, tuple(tuple(c) for c in res["choices"])) if res["choices"] else None
        pooled = GenerationStats()  # all prompts' steps together: the stats' own definitions apply
        decoded = 0  # each answer's tokens after its first (the prefill's): what the decode time made
        for q in qs:
            r = llm.generate(q, drafter=d, max_new_tokens=128, max_tree_nodes=a.max_nodes)
            pooled.steps += r.stats.steps
            pooled.new_tokens += r.stats.new_tokens
            pooled.t_decode += r.stats.t_decode
            decoded += max(0, r.stats.new_tokens - 1)
        tps = decoded / pooled.t_decode if pooled.t_decode > 0 else 0.0
        measured = {"mean_accepted_length": pooled.mean_accepted_length, "tok_per_s": tps}
        print(
            f"measured on {len(qs)} prompts of {a.check_file}: mean accepted length "
            f"{measured['mean_accepted_length']:.2f} (expected {res['expected_len']:.2f}), "
            f"{measured['tok_per_s']:.1f} tok/s (expected {res['expected_tok_per_s']:.1f})"
        )
    if a.write and not res["choices"]:
        print("plain decoding is expected to be fastest here; no tree stored", file=sys.stderr)
    elif a.write:
        d = Path(a.heads) if a.heads not in (None, "default") else None
        if d is None:
            from ..drafters.medusa import shipped_heads_for

            d = shipped_heads_for(llm.model_name)
        rec = tree_record(
            res,
            lat,
            a.max_nodes,
            a.context,
            rank_accuracy=acc,
            draft_cost_ms=round(draft_cost * 1000, 2),
            measured=measured,
        )
        f = store_machine_tree(llm.model, d, llm.model_name, rec, heads.draft_path)
        print(f"wrote this machine's tree to {f}", file=sys.stderr)
    else:
        print("nothing stored (--write stores this tree where the drafters look for it)", file=sys.stderr)
    return 0

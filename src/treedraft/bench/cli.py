"""`treedraft bench` on the command line: method names, building the methods, running, writing the report."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..drafters.hybrid import fresh_copy
from ..drafters.suffix_store import DEFAULT_MAX_TOKENS
from . import harness
from .baselines import HFMethod, llama_cpp_build, llama_cpp_method, load_hf_baseline
from .harness import (
    BUILTIN_PROMPTS,
    DEFAULT_BASELINES,
    DEFAULT_DATASET,
    REFERENCE,
    BenchError,
    BenchPrompt,
    EngineMethod,
    Method,
    find_default_dataset,
    load_prompts,
    run_bench,
    select_prompts,
)
from .report import machine_info, write_report

# ---------------------------------------------------------------------------------------------
# building the real methods for a loaded model


def known_methods() -> list[str]:
    """Every method name: the baselines plus every registered drafter."""
    from ..drafters.registry import names

    return ["hf", "hf-pld", "plain"] + [d for d in names() if d != "none"] + ["llama.cpp", "llama.cpp-pld"]


def parse_methods(spec: str) -> list[str]:
    """'all' or a comma list -> method names; 'none' means plain; unknown names list the choices."""
    known = known_methods()
    names = known if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    names = ["plain" if n == "none" else n for n in names]
    bad = [n for n in names if n not in known]
    if bad:
        raise BenchError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(known)} or 'all'")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # ('none' is 'plain')
        print(f"[bench] --methods names {', '.join(twice)} more than once: each runs once", file=sys.stderr)
    return list(dict.fromkeys(names))


def build_methods(
    names: Sequence[str],
    llm: Any,
    model_path: Path,
    config: Any,
    *,
    dtype: Any = None,
    heads: str | None = "default",
    pld_tokens: int = 10,
    fresh_state: bool = False,
) -> tuple[dict[str, Method], dict[str, str]]:
    """Construct the requested methods; each one that cannot be built is skipped with the reason.

    ``fresh_state``: treedraft's drafters start every run with nothing learned (see ``EngineMethod``)."""
    methods: dict[str, Method] = {}
    skipped: dict[str, str] = {}
    sp = config.sampling
    n = config.max_new_tokens
    hf_model = None
    llama_cpp: dict[str, Any] = {}
    for name in names:
        try:
            if name in ("hf", "hf-pld"):
                if hf_model is None:
                    hf_model = load_hf_baseline(model_path, dtype, llm.device)
                methods[name] = HFMethod(
                    hf_model,
                    n,
                    pld_tokens if name == "hf-pld" else None,
                    sp.temperature,
                    sp.top_p,
                    sp.top_k,
                    sp.seed,
                    min_p=sp.min_p,
                )
            elif name in ("llama.cpp", "llama.cpp-pld"):
                methods[name] = llama_cpp_method(name, model_path, config, pld_tokens, llama_cpp)
            elif name == "plain":
                methods[name] = EngineMethod(llm.text, config, None)
            else:
                # each method its own copy of a learning drafter: `suffix` and `hybrid-suffix` in one run would
                # otherwise share the LLM's in-memory suffix index, and the second to run a prompt would draft
                # the first one's output of it (a persistent --suffix-store stays shared: fresh() keeps it)
                drafter = fresh_copy(llm.get_drafter(name, heads=heads))
                methods[name] = EngineMethod(llm.text, config, drafter, fresh_state)
        except Exception as e:
            skipped[name] = f"{type(e).__name__}: {e}"
    return methods, skipped


# ---------------------------------------------------------------------------------------------
# CLI


def default_out_dir(stamp: str | None = None) -> Path:
    """A fresh folder for one run under the user cache, never inside the repo: <cache>/bench/<stamp>[-N].

    ``stamp`` defaults to the local date and time (YYYYmmdd-HHMMSS); -2, -3, ... is added while taken.
    """
    from ..models.registry import cache_dir

    base = cache_dir() / "bench" / (stamp or time.strftime("%Y%m%d-%H%M%S"))
    out, n = base, 1
    while out.exists():  # two runs in the same second
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def fresh_drafter_state(a: argparse.Namespace) -> bool:
    """--fresh-drafter-state as given, else on exactly with --busy-core; refused next to --suffix-store."""
    fresh = a.busy_core if a.fresh_drafter_state is None else a.fresh_drafter_state
    if fresh and a.suffix_store is not None:
        raise BenchError(
            "--fresh-drafter-state (the default with --busy-core) gives every run an empty in-memory suffix "
            f"index, so --suffix-store {a.suffix_store} would go unused; drop --suffix-store, or pass "
            "--no-fresh-drafter-state to draft from the store (runs then also learn from earlier runs)"
        )
    return fresh


def quiet_transformers_bars() -> None:
    """No progress bars from transformers' loads: its own (hf logging) and the GGUF conversion's plain tqdm."""
    import functools

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # (no gguf support installed: no such bar)
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not isinstance(bar, functools.partial):
        gguf_utils.tqdm = functools.partial(bar, disable=True)


def cmd_bench(a: argparse.Namespace) -> int:
    """`treedraft bench`: load, build methods, run interleaved, write the report."""
    import torch

    from .. import load
    from ..api import pick_device, pick_dtype
    from ..models.registry import resolve

    methods_wanted = parse_methods(a.methods)
    if a.no_progress:  # the hf baseline's load draws transformers' own bars ("Loading weights", GGUF conversion)
        quiet_transformers_bars()
    if a.threads is not None:
        if a.threads < 1:
            raise BenchError(f"--threads must be >= 1, got {a.threads}")
        torch.set_num_threads(a.threads)
    if a.dataset:
        dataset: Path | None = Path(a.dataset)
        prompts = load_prompts(dataset)
    else:
        dataset = find_default_dataset()
        if dataset is not None:
            prompts = load_prompts(dataset)
        else:
            print(
                f"[bench] {DEFAULT_DATASET} not found; using {len(BUILTIN_PROMPTS)} built-in prompts "
                "(pass --dataset FILE)",
                file=sys.stderr,
            )
            prompts = [BenchPrompt(f"builtin-{i}", c, t) for i, (c, t) in enumerate(BUILTIN_PROMPTS)]
    if a.num_prompts is not None and a.num_prompts > len(prompts):
        print(
            f"[bench] --num-prompts {a.num_prompts}, but there are {len(prompts)} prompts: using all", file=sys.stderr
        )
    prompts = select_prompts(prompts, a.num_prompts)
    if a.max_new_tokens <= 0:
        raise BenchError(f"--max-new-tokens must be positive, got {a.max_new_tokens}")
    if a.pld_tokens < 1:
        raise BenchError(
            f"--pld-tokens must be >= 1 (tokens hf-pld / llama.cpp-pld copy per match), got {a.pld_tokens}"
        )
    idle = [
        f
        for f, on in (
            ("--top-p", a.top_p != 1.0),
            ("--top-k", a.top_k != 0),
            ("--min-p", a.min_p != 0),
            ("--seed", a.seed != 0),
        )
        if on
    ]
    if a.temperature == 0 and idle:
        from ..cli import idle_sampling_note

        print(f"[bench] {idle_sampling_note(idle)}", file=sys.stderr)
    if a.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {a.warmup}")
    baselines = [b.strip() for b in a.baselines.split(",") if b.strip()]
    bad = [b for b in baselines if b not in known_methods()]
    if bad:
        raise BenchError(f"unknown --baselines {', '.join(bad)}; choose from {', '.join(known_methods())}")
    idle = [b for b in baselines if b not in methods_wanted]
    if idle and a.baselines != ",".join(DEFAULT_BASELINES):  # asked for, but nothing to compare with: said
        fallback = len(idle) == len(baselines) and "plain" in methods_wanted  # (else the report had no speedups)
        print(
            f"[bench] --baselines {', '.join(idle)}: not among --methods, so no speedup column against it"
            + ("; speedups are against plain instead" if fallback else ""),
            file=sys.stderr,
        )
        if fallback:
            baselines = ["plain"]
    from ..sampling import SamplingParams

    try:  # a bad sampling limit is said now, before the model load and the report directory (as generate does)
        SamplingParams(a.temperature, a.top_k, a.top_p, a.seed, a.min_p)
    except ValueError as e:
        raise BenchError(str(e)) from None
    out = Path(a.out) if a.out else default_out_dir()
    if (out / "records.json").is_file():  # (it was replaced without a word)
        print(f"[bench] --out {out} already holds a bench report: this run replaces it", file=sys.stderr)
    if out.exists() and not out.is_dir():  # (mkdir said "[Errno 17] File exists")
        raise BenchError(f"--out {out} is a file; give a directory for the report (it is created if missing)")
    try:  # checked now: a path that cannot take the report would otherwise fail after the whole run
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"--out {out}: {e}") from None

    fresh = fresh_drafter_state(a)
    t = time.perf_counter()
    from ..cli import draft_kwargs, model_kwargs, suffix_kwargs

    llm = load(a.model, drafter=None, **model_kwargs(a), **suffix_kwargs(a), **draft_kwargs(a))
    cfg = llm.config(
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        min_p=a.min_p,
        seed=a.seed,
        max_tree_nodes=a.max_tree_nodes,
    )
    encoded = [(p, llm.encode_prompt(p.text, raw=a.raw)) for p in prompts]
    dtype = pick_dtype(a.dtype, pick_device(a.device))
    methods, skipped = build_methods(
        methods_wanted,
        llm,
        resolve(a.model),
        cfg,
        dtype=dtype,
        heads=a.heads,
        pld_tokens=a.pld_tokens,
        fresh_state=fresh,
    )
    from ..api import freeze_gc

    freeze_gc()  # no full-collection pauses (75-200 ms) inside the timed generations of any method
    print(
        f"[bench] loaded in {time.perf_counter() - t:.1f}s; methods: {', '.join(methods) or '-'}"
        + (f"; skipped: {', '.join(skipped)}" if skipped else ""),
        file=sys.stderr,
    )
    for m, why in skipped.items():
        print(f"[bench] skipped {m}: {why}", file=sys.stderr)
    run_cfg = {
        "command": _command_line(a, dataset),
        "model": llm.model_name,
        "dataset": str(dataset) if dataset else "built-in prompts",
        "prompts": len(encoded),
        "max_new_tokens": a.max_new_tokens,
        "decoding": "greedy"
        if a.temperature == 0
        else f"sampling T={a.temperature} top_p={a.top_p} top_k={a.top_k}"
        + (f" min_p={a.min_p}" if a.min_p else "")
        + f" seed={a.seed}",
        "device": llm.device,
        "dtype": str(dtype).removeprefix("torch."),
        # the own runtime's linear weights as resolved (--weights auto measures them) and its KV cache storage;
        # a baseline on other weights (hf: transformers in fp32) need not give plain's tokens
        "weights": (getattr(llm.model, "weights_info", None) or {}).get("resolved", a.weights),
        # (only where a method drafts with it: the line said "the target itself" under every run)
        **(
            {"draft_model": f"{a.draft_model or 'the target itself'} ({a.draft_weights} weights)"}
            if any(
                getattr(getattr(m, "drafter", None), "name", None) in ("draft-model", "hybrid-draft")
                for m in methods.values()
            )
            else {}
        ),  # fmt: skip
        "kv_dtype": str(getattr(llm.model, "kv_dtype", None) or dtype).removeprefix("torch."),
        "attn_scores": "bf16" if getattr(llm.model, "bf16_scores", False) else "float32",
        "torch_threads": torch.get_num_threads(),
        **machine_info(),
        "kernels": _kernels_line(),
        "warmup": a.warmup,
        "max_tree_nodes": a.max_tree_nodes,
        "hf_prompt_lookup_num_tokens": a.pld_tokens,
        "fresh_drafter_state": fresh,
        "suffix_store": a.suffix_store,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if str(llm.device).startswith("cuda"):
        run_cfg["gpu"] = torch.cuda.get_device_name(torch.device(llm.device))
    if any(m.startswith("llama.cpp") for m in methods):
        run_cfg["llama_cpp"] = llama_cpp_build()
    try:
        import transformers

        run_cfg["transformers"] = transformers.__version__
    except ImportError:
        pass
    reference = next((m for m in (REFERENCE, "hf") if m in methods), None)
    result = run_bench(
        encoded,
        methods,
        warmup=a.warmup,
        baselines=baselines,
        reference=reference,
        greedy=a.temperature == 0,
        seeded=a.seed is not None,
        skipped=skipped,
        progress=not a.no_progress,
        config=run_cfg,
        busy_core=a.busy_core,
    )
    paths = write_report(result, out, decode=lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=False))
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("[bench] wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


def _kernels_line() -> str:
    """The loaded native kernels' best compiled path, and the -march they were built for when overridden
    (TREEDRAFT_KERNEL_MARCH, e.g. an AVX2 build measured on an AVX-512 machine); "none" without them."""
    from ..kernels import available, build_info, paths

    if not available():
        return "none"
    march = build_info().get("march")
    return paths()[0] + (f" (built with -march={march})" if march else "")


def _command_line(a: argparse.Namespace, dataset: Path | None) -> str:
    """The command that reproduces this run (options spelled out)."""
    import shlex

    parts = ["treedraft", "bench", "--methods", a.methods, "--max-new-tokens", str(a.max_new_tokens)]
    if a.dataset:
        parts += ["--dataset", a.dataset]
    if a.num_prompts is not None:
        parts += ["--num-prompts", str(a.num_prompts)]
    for opt, default in (
        ("model", None),
        ("device", "auto"),
        ("dtype", "fp32"),
        ("runtime", "auto"),
        ("weights", "auto"),
        ("temperature", 0.0),
        ("seed", 0),
        ("top_p", 1.0),
        ("top_k", 0),
        ("min_p", 0.0),
        ("warmup", 1),
        ("max_tree_nodes", 64),
        ("pld_tokens", 10),
        ("heads", "default"),
        ("kv_dtype", "auto"),
        ("attn_scores", "auto"),
        ("draft_model", None),
        ("draft_weights", "auto"),
        ("baselines", "hf,plain"),
    ):
        v = getattr(a, opt)
        if opt == "model" or v != default:
            parts += ["--" + opt.replace("_", "-"), str(v)]
    if a.suffix_store is not None:
        parts += ["--suffix-store", a.suffix_store]
    if a.suffix_max_tokens != DEFAULT_MAX_TOKENS:
        parts += ["--suffix-max-tokens", str(a.suffix_max_tokens)]
    if a.suffix_max_total_tokens is not None:
        parts += ["--suffix-max-total-tokens", str(a.suffix_max_total_tokens)]
    if a.suffix_share:
        parts.append("--suffix-share")
    if a.threads is not None:
        parts += ["--threads", str(a.threads)]
    if a.raw:
        parts.append("--raw")
    if a.busy_core:
        parts.append("--busy-core")
    if a.fresh_drafter_state is not None:
        parts.append("--fresh-drafter-state" if a.fresh_drafter_state else "--no-fresh-drafter-state")
    if a.out:  # the default is a fresh folder per run: a rerun should not reuse this one
        parts += ["--out", str(a.out)]
    return shlex.join(parts)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `treedraft bench` to the CLI."""
    from ..models.registry import DEFAULT_MODEL

    b = subparsers.add_parser(
        "bench",
        help="benchmark decoding methods side by side (Spec-Bench style)",
        description=harness.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument(
        "--dataset",
        default=None,
        help=f"jsonl of {{question_id, category, turns}} or {{prompt}} (default: {DEFAULT_DATASET} "
        "next to the repo when present, else a few built-in prompts)",
    )
    b.add_argument(
        "--methods",
        default="all",
        help="comma list or 'all' (hf, hf-pld, plain, every drafter, llama.cpp, llama.cpp-pld); "
        "methods that cannot be built are skipped with the reason",
    )
    b.add_argument("--baselines", default=",".join(DEFAULT_BASELINES), help="speedups are reported against these")
    b.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt and method (default 128)")
    b.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="use this many prompts, round-robin over categories (default: all)",
    )
    b.add_argument(
        "--out",
        default=None,
        help="output directory (default: a new folder under ~/.cache/treedraft/bench, or "
        "$TREEDRAFT_CACHE/bench; the path is printed at the end)",
    )
    b.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs per method")
    b.add_argument("--model", default=DEFAULT_MODEL, help="registry name, .gguf file or HF directory")
    b.add_argument(
        "--heads", default="default", help="Medusa heads and/or EAGLE drafter directory (default: the shipped ones)"
    )
    b.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    b.add_argument("--dtype", default="fp32", help="fp32 (default, as the HF baseline), bf16, fp16, auto")
    b.add_argument("--runtime", default="auto", help="own, hf or auto (treedraft's target runtime)")
    from ..models.quant import WEIGHTS

    b.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHTS,
        help="target linear weights on cpu (see `treedraft generate --help`)",
    )
    from ..cli import add_draft_model_args, add_kv_dtype_arg, add_suffix_args

    add_kv_dtype_arg(b)
    add_draft_model_args(b)  # method "draft-model"
    # method "suffix" learns from every run, the warm-up (first prompt) included: see docs/drafters.md
    add_suffix_args(b)
    b.add_argument("--raw", action="store_true", help="no chat template")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min_p x the best one's probability (0: off)"
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--max-tree-nodes", type=int, default=64)
    b.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf-pld / llama.cpp-pld")
    b.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); 1 is often faster on a busy machine",
    )
    b.add_argument(
        "--busy-core",
        action="store_true",
        help="repeat every run while a spinning process keeps one core busy; the report gives busy/quiet "
        "wall-time ratios per method (doubles the run time)",
    )
    b.add_argument(
        "--fresh-drafter-state",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every timed run (and its --busy-core repeat) drafts with a fresh drafter: nothing learned from "
        "earlier runs (the suffix index starts empty), so no run is sped up by another's output "
        "(default: on with --busy-core, else off: runs share one drafter, as requests to a server do)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_bench)

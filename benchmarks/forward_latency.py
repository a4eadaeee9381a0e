"""Own runtime vs transformers on the same weights, measured side by side in one run.

1. Latency of one forward of k tokens (k = 1, 2, 4, ..., 64) on top of a 512-token KV cache,
   median over several repetitions, runtimes interleaved per repetition (tree sizing depends on it).
2. Plain greedy decoding tokens/s, own engine vs transformers ``generate``, same prompt and length
   (EOS ignored by both so the lengths match), interleaved, and the own/HF ratio.

    python benchmarks/forward_latency.py            # writes benchmarks/results/forward_latency.{md,json}
    python benchmarks/forward_latency.py --weights fp32,int4,int8   # per weight format (issue 11), own runtime:
        1-token and 16-token-tree forward on a 512-token cache, weight bytes / measured read bandwidth, and a
        per-op profile of one 1-token step -> benchmarks/results/forward_latency_weights.{md,json}

Timings live here, never in unit-test asserts. On a shared machine the absolute numbers are noisy;
the ratios (measured in the same run, interleaved) are what to read.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a detailed essay about the history of the printing press and its effect on Europe."


def load_runtimes(model: str, max_seq_len: int):
    """(treedraft LLM on the own runtime, transformers model on the same weights), both fp32 on cpu."""
    import treedraft
    from treedraft.bench import load_hf_baseline
    from treedraft.models.registry import resolve

    llm = treedraft.load(model, drafter=None, device="cpu", dtype="fp32", runtime="own", max_seq_len=max_seq_len)
    hf = load_hf_baseline(resolve(model), torch.float32, "cpu")
    return llm, hf


def time_call(fn) -> float:
    """Seconds one call of fn takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@torch.inference_mode()
def forward_latency(llm, hf, context: int, ks: list[int], reps: int, warmup: int = 2) -> dict:
    """Median seconds of one k-token forward on a ``context``-token cache, per runtime and k.

    The own runtime is timed by :func:`treedraft.training.calibrate.measure_latency`, the very
    numbers tree sizing uses (tree-verify mask included), one repetition per call; transformers
    gets the same k sweep (causal, its own cache). The two sweeps alternate order per repetition.
    """
    from treedraft.training.calibrate import measure_latency

    model = llm.model
    V = model.vocab_size
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, V, (1, context), generator=g)
    new = torch.randint(0, V, (1, max(ks)), generator=g)

    # transformers renamed past_key_values -> cache (5.x); use whichever this version takes
    cache_kw = "cache" if "cache" in inspect.signature(type(hf).forward).parameters else "past_key_values"
    out = hf(input_ids=ctx, use_cache=True)
    pkv = getattr(out, cache_kw)

    def hf_step(k: int):
        pos = torch.arange(context, context + k)
        try:
            return hf(input_ids=new[:, :k], position_ids=pos[None], use_cache=True, **{cache_kw: pkv}).logits
        finally:
            pkv.crop(-k)  # drop the k new entries again (DynamicCache grows by concatenation)

    # sanity: both runtimes compute the same thing on the same context and 8 new tokens
    cache = model.new_cache(context + 8)
    model.forward(ctx, torch.arange(context), cache, 0, logits_for=slice(-1, None))
    own8 = model.forward(new[:, :8], torch.arange(context, context + 8), cache, context)[0]
    diff = (own8 - hf_step(8)).abs().max().item()
    del cache

    def hf_sweep() -> dict[int, float]:
        out = {}
        for k in ks:  # one untimed call per size first, as measure_latency does
            hf_step(k)
            out[k] = time_call(lambda: hf_step(k))
        return out

    sweeps = {"own": lambda: measure_latency(model, context, ks, reps=1), "hf": hf_sweep}
    for _ in range(warmup):
        for fn in sweeps.values():
            fn()
    times: dict[str, dict[int, list[float]]] = {n: {k: [] for k in ks} for n in sweeps}
    for r in range(reps):
        for name in list(sweeps) if r % 2 == 0 else list(sweeps)[::-1]:
            for k, t in sweeps[name]().items():
                times[name][k].append(t)
    return {
        "context": context,
        "reps": reps,
        "max_abs_logit_diff_k8": diff,
        "median_s": {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()},
        "all_s": times,
    }


@torch.inference_mode()
def decode_ratio(llm, hf, new_tokens: int, reps: int) -> dict:
    """Plain greedy decode tokens/s, own engine vs transformers generate, interleaved per repetition."""
    from treedraft.engine import GenerationConfig

    ids = llm.encode_prompt(PROMPT)
    cfg = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    x = torch.tensor([ids])
    no_eos = dict(eos_token_id=None, pad_token_id=0)  # generate the full length, like ignore_eos

    def own() -> tuple[list[int], float]:
        r = llm.engine.generate(ids, cfg, None)
        return r.token_ids, r.stats.tokens_per_s

    def hf_gen() -> tuple[list[int], None]:
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens, **no_eos)
        return out[0, x.shape[1] :].tolist(), None

    runs = {"own": own, "hf": hf_gen}
    for fn in runs.values():  # warm-up
        fn()
    rows = []
    for r in range(reps):
        row = {}
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            t = time.perf_counter()
            toks, decode_tps = runs[name]()
            wall = time.perf_counter() - t
            row[name] = {
                "tokens": len(toks),
                "wall_s": wall,
                "tokens_per_s": len(toks) / wall,
                "decode_only_tokens_per_s": decode_tps,
                "ids": toks,
            }
        row["ratio"] = row["own"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        rows.append(row)
    same = all(r["own"]["ids"] == r["hf"]["ids"] for r in rows)
    med = {n: statistics.median(r[n]["tokens_per_s"] for r in rows) for n in runs}
    return {
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "reps": reps,
        "same_output": same,
        "median_tokens_per_s": med,
        "ratio_of_medians": med["own"] / med["hf"],
        "median_paired_ratio": statistics.median(r["ratio"] for r in rows),
        "own_decode_only_tokens_per_s": statistics.median(r["own"]["decode_only_tokens_per_s"] for r in rows),
        "runs": [
            {n: ({k: v for k, v in r[n].items() if k != "ids"} if n != "ratio" else r[n]) for n in r} for r in rows
        ],
    }


def markdown(res: dict) -> str:
    """The report."""
    lat, dec, env = res["latency"], res["decode"], res["environment"]
    lines = [
        "# Own runtime vs transformers (same weights, fp32, cpu)",
        "",
        f"- command: `{env['command']}`",
        f"- model: `{env['model']}`",
        f"- date: {env['date']}",
        f"- torch {env['torch']}, transformers {env['transformers']}, {env['threads']} thread(s), {env['platform']}",
        "",
        "## Plain greedy decoding",
        "",
        f"{dec['new_tokens']} new tokens (EOS ignored) after a {dec['prompt_tokens']}-token chat prompt, "
        f"{dec['reps']} interleaved repetitions, wall time incl. prefill. Same output: {dec['same_output']}.",
        "",
        "| runtime | median tok/s |",
        "|---|---|",
        f"| own engine | {dec['median_tokens_per_s']['own']:.1f} |",
        f"| transformers `generate` | {dec['median_tokens_per_s']['hf']:.1f} |",
        "",
        f"**own / HF = {dec['median_paired_ratio']:.2f}x** (median of per-repetition ratios; "
        f"ratio of medians {dec['ratio_of_medians']:.2f}x). Own decode-only (prefill excluded): "
        f"{dec['own_decode_only_tokens_per_s']:.1f} tok/s.",
        "",
        f"## One forward of k tokens on a {lat['context']}-token cache",
        "",
        f"Median of {lat['reps']} interleaved repetitions; own runtime timed by "
        "`treedraft.training.calibrate.measure_latency` (tree-verify mask, as tree sizing sees it), "
        "transformers causal. Logits agree: max |diff| = "
        f"{lat['max_abs_logit_diff_k8']:.1e} (k = 8).",
        "",
        "| k | own ms | HF ms | HF / own | own ms / token |",
        "|---|---|---|---|---|",
    ]
    for k, o in lat["median_s"]["own"].items():
        h = lat["median_s"]["hf"][k]
        lines.append(f"| {k} | {o * 1e3:.1f} | {h * 1e3:.1f} | {h / o:.2f} | {o * 1e3 / int(k):.2f} |")
    return "\n".join(lines) + "\n"


def read_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """Bytes/s of a streaming read (sum of a ``mb``-MB float32 tensor, best of ``reps``)."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    best = min(time_call(x.sum) for _ in range(reps))
    return x.numel() * 4 / best


@torch.inference_mode()
def profile_step(model, context: int, top: int = 12) -> list[dict]:
    """Per-op self CPU time of one 1-token forward on a ``context``-token cache (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.new_cache(context + 2)
    ctx = torch.randint(0, model.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    model.forward(ctx, torch.arange(context), cache, 0, logits_for=slice(-1, None))
    tok, pos = ctx[:, :1], torch.tensor([context])
    model.forward(tok, pos, cache, context)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        model.forward(tok, pos, cache, context)
        wall = time.perf_counter() - t
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in rows)
    out = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in rows[:top]]
    return [
        {"op": "(all ops, profiled)", "calls": sum(e.count for e in rows), "self_ms": total / 1e3},
        {"op": "(wall, profiled)", "calls": 1, "self_ms": wall * 1e3},
    ] + out


def weights_table(model_name: str, formats: list[str], context: int, reps: int) -> dict:
    """Per weight format: 1- and 16-token forward latency, weight bytes, bandwidth bound, one-step profile."""
    import treedraft
    from treedraft.models.matmul import is_exact_plan
    from treedraft.models.quant import weight_bytes
    from treedraft.training.calibrate import measure_latency

    bw = read_bandwidth()
    llms = {f: treedraft.load(model_name, drafter=None, weights=f, max_seq_len=context + 64) for f in formats}
    lat: dict[str, dict[int, list[float]]] = {f: {1: [], 16: []} for f in formats}
    for r in range(reps):  # interleaved, order alternating
        for f in formats if r % 2 == 0 else formats[::-1]:
            for k, t in measure_latency(llms[f].model, context, (1, 16), reps=1).items():
                lat[f][k].append(t)
    rows = {}
    for f, llm in llms.items():
        nbytes = weight_bytes(llm.model)
        t1, t16 = (statistics.median(lat[f][k]) for k in (1, 16))
        rows[f] = {
            "ms_1": t1 * 1e3,
            "ms_16": t16 * 1e3,
            "tree16_over_1": t16 / t1,
            "weight_bytes": nbytes,
            "bound_ms": nbytes / bw * 1e3,
            "ms_1_over_bound": t1 / (nbytes / bw),
            "info": getattr(llm.model, "weights_info", {"weights": f}),
            # fp32: the row-invariant mm_f32 (exact plan, models/plan.py) or the tuned BLAS plan
            "fp32_kernel": "mm_f32 (exact)"
            if is_exact_plan(getattr(llm.model, "matmul_plan", None))
            else "fp32 BLAS plan",
            "profile_1_token": profile_step(llm.model, context),
        }
    return {"context": context, "reps": reps, "read_bandwidth_GBps": bw / 1e9, "formats": rows}


def weights_markdown(res: dict, env: dict) -> str:
    """The per-format report."""
    lines = [
        "# Forward latency per weight format (own runtime, cpu)",
        "",
        f"- command: `{env['command']}`",
        f"- {env['cpu']}; torch {env['torch']}, {env['threads']} thread(s); date {env['date']}",
        f"- measured read bandwidth (sum of a 512 MB tensor): {res['read_bandwidth_GBps']:.1f} GB/s",
        "",
        f"Median of {res['reps']} interleaved repetitions on a {res['context']}-token cache; 16 = a 16-token "
        "tree forward (tree mask). Bound = weight bytes / read bandwidth.",
        "",
        "| weights | kernels | 1-token ms | 16-token ms | 16 / 1 | weight MB | bound ms | 1-token / bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f, r in res["formats"].items():
        k = ", ".join(f"{a}: {b}" for a, b in r["info"].get("kernels", {}).items()) or r.get("fp32_kernel", "fp32 plan")
        lines.append(
            f"| {f} | {k} | {r['ms_1']:.1f} | {r['ms_16']:.1f} | {r['tree16_over_1']:.2f} | "
            f"{r['weight_bytes'] / 1e6:.0f} | {r['bound_ms']:.1f} | {r['ms_1_over_bound']:.1f} |"
        )
    for f, r in res["formats"].items():
        lines += [
            "",
            f"## Where one 1-token step goes: {f} (torch.profiler, self CPU time)",
            "",
            "| op | calls | self ms |",
            "|---|---|---|",
        ]
        lines += [f"| `{p['op']}` | {p['calls']} | {p['self_ms']:.2f} |" for p in r["profile_1_token"]]
    return "\n".join(lines) + "\n"


def _cpu_line() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and write the report."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ks", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=7, help="latency repetitions (median)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--weights",
        default=None,
        help="comma list of weight formats (fp32,int4,int8): per-format table instead of own vs HF",
    )
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.weights:
        from treedraft.models.quant_load import check_weights

        formats = [check_weights(f) for f in a.weights.split(",") if f]
        res = weights_table(a.model, formats, a.context, a.reps)
        env = {
            "command": "python benchmarks/forward_latency.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "cpu": _cpu_line(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "forward_latency_weights.json").write_text(json.dumps({"environment": env, **res}, indent=1) + "\n")
        md = weights_markdown(res, env)
        (out / "forward_latency_weights.md").write_text(md)
        print(md)
        return 0
    ks = [int(k) for k in a.ks.split(",")]
    import transformers

    t = time.perf_counter()
    llm, hf = load_runtimes(a.model, max(a.context + max(ks), 1024))
    print(f"loaded both runtimes in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    t = time.perf_counter()
    lat = forward_latency(llm, hf, a.context, ks, a.reps)
    print(f"latency done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    t = time.perf_counter()
    dec = decode_ratio(llm, hf, a.decode_tokens, a.decode_reps)
    print(f"decode done in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    env = {
        "command": "python benchmarks/forward_latency.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": a.model,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    res = {"environment": env, "latency": lat, "decode": dec}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forward_latency.json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    (out / "forward_latency.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

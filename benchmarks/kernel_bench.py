"""treedraft's native Q4_1/Q8_0 kernel vs PyTorch's int4pack kernel vs fp32 MKL, side by side.

For SmolLM2-135M's linear shapes and M = 1..32 activation rows it times
  * ``ours``     treedraft.kernels.mm (Q4_1; lm_head Q8_0), float32 activations
  * ``int4pack`` torch.ops.aten._weight_int4pack_mm_for_cpu, group 32, bfloat16 activations
               (the lm_head as int4 too: PyTorch has no Q8_0 x float kernel)
  * ``fp32``     F.linear on dequantized float32 weights (MKL)
two ways:
  1. per shape, rotating through enough copies of the weight (> L3) that every call streams it
     from memory, as in a real forward;
  2. a whole forward's linears (30 layers x q,k,v,o,gate,up,down + lm_head, distinct random
     weights, in order): the per-step cost a decoding / tree-verification step pays.
Each number is the minimum over repetitions (the machine is shared); GB/s = weight bytes / time.

    python benchmarks/kernel_bench.py [--quick] [--threads 2] [--busy]

--busy keeps one core loaded by a spinning child process during the run. Writes
benchmarks/results/kernel_bench{,_busy}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import treedraft.kernels as tk

ROOT = Path(__file__).resolve().parents[1]
H, I, KV, V, LAYERS = 576, 1536, 192, 49152, 30
SHAPES = [  # (name, N, K, kind, count per forward)
    ("q/o 576x576", H, H, "q4_1", 2 * LAYERS),
    ("k/v 192x576", KV, H, "q4_1", 2 * LAYERS),
    ("qkv fused 960x576", H + 2 * KV, H, "q4_1", 0),
    ("gate/up 1536x576", I, H, "q4_1", 2 * LAYERS),
    ("gate+up fused 3072x576", 2 * I, H, "q4_1", 0),
    ("down 576x1536", H, I, "q4_1", LAYERS),
    ("lm_head 49152x576", V, H, "q8_0", 1),
]
L3_BYTES = 48 << 20  # rotate through at least this many weight bytes per shape (L3 is 35.8 MB here)


def machine() -> str:
    """lscpu model name, thread count, torch version."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        model = platform.processor()
    return f"{model}, {torch.get_num_threads()} threads, torch {torch.__version__}, paths {tk.paths()}"


def random_weight(N: int, K: int, kind: str, g: torch.Generator) -> dict:
    """Random Q4_1/Q8_0 weight in the three formats (ours, int4pack, fp32)."""
    B = K // 32
    d = (torch.rand(N, B, generator=g) * 0.01 + 0.001).half().float()
    if kind == "q4_1":
        q = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
        m = (-torch.rand(N, B, generator=g) * 0.08).half().float()
        pw = tk.pack_q4_1(d, m, q)
        zero = m + 8 * d
    else:
        q8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        pw = tk.pack_q8_0(d, q8)
        q = (q8.float() / 16 + 8).round().clamp(0, 15).to(torch.uint8)  # int4 stand-in, same shape
        zero = 8 * d
    w32 = pw.dequantize()
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    sz = torch.stack([d.T, zero.T], dim=2).to(torch.bfloat16).contiguous()  # (K/32, N, 2)
    return {"ours": pw, "int4pack": (packed4, sz), "fp32": w32}


def call(method: str, x: dict, w) -> torch.Tensor:
    """One linear with the given method; x holds the activations in each needed dtype."""
    if method == "ours":
        return tk.mm(x["f32"], w)
    if method == "int4pack":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x["bf16"], w[0], 32, w[1])
    return F.linear(x["f32"], w)


def weight_bytes(method: str, w) -> int:
    """Bytes of weight data the method streams per call."""
    if method == "ours":
        return w.nbytes
    if method == "int4pack":
        return w[0].numel() * w[0].element_size() + w[1].numel() * w[1].element_size()
    return w.numel() * 4


CPU_TIMES: list[float] = []  # process CPU seconds per call of the last time_calls (all threads)


def time_calls(fn, reps: int, inner: int) -> float:
    """Min over reps of the mean wall time of `inner` calls (seconds); CPU time kept in CPU_TIMES."""
    fn()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
        best_cpu = min(best_cpu, (time.process_time() - c0) / inner)
    CPU_TIMES[:] = [best_cpu]
    return best


def read_bandwidth() -> float:
    """Measured memory read bandwidth (GB/s) of a 256 MB float32 sum with torch's threads."""
    a = torch.ones(64 << 20)
    t = time_calls(lambda: a.sum(), reps=5, inner=2)
    return a.numel() * 4 / t / 1e9


def spin() -> None:  # pragma: no cover - background load
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and row counts")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--busy", action="store_true", help="keep one core busy with a spinning process")
    ap.add_argument("--rows", default="1,2,4,8,16,32", help="row counts of the forward sweep")
    ap.add_argument("--shape-rows", default="1,4,16", help="row counts of the per-shape table")
    ap.add_argument("--methods", default="ours,int4pack,fp32")
    ap.add_argument("--out", default="", help="result name under benchmarks/results/ (default kernel_bench[_busy])")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not tk.available():
        sys.exit(f"native kernel unavailable: {tk.unavailable_reason()}")
    tk.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shape_rows = [int(r) for r in args.shape_rows.split(",")]
    methods = args.methods.split(",")
    reps = 2 if args.quick else 5
    busy = None
    if args.busy:
        busy = mp.get_context("spawn").Process(target=spin, daemon=True)
        busy.start()
    g = torch.Generator().manual_seed(0)
    res: dict = {
        "machine": machine(),
        "threads": args.threads,
        "busy": args.busy,
        "command": "python benchmarks/kernel_bench.py " + " ".join(sys.argv[1:]),
        "read_bandwidth_GBs": read_bandwidth(),
        "shapes": [],
        "forward": [],
    }
    print(res["machine"], f"read bandwidth {res['read_bandwidth_GBs']:.1f} GB/s", flush=True)
    try:
        # 1. per shape, weights streamed from memory (rotating copies)
        for name, N, K, kind, _ in SHAPES:
            one = random_weight(N, K, kind, g)
            ncopy = max(2, -(-L3_BYTES // one["ours"].nbytes))
            copies = [one] + [random_weight(N, K, kind, g) for _ in range(ncopy - 1)]
            for M in shape_rows:
                x = torch.randn(M, K, generator=g)
                xs = {"f32": x, "bf16": x.to(torch.bfloat16)}
                row = {"shape": name, "N": N, "K": K, "kind": kind, "M": M}
                for meth in methods:
                    it = iter(range(1 << 62))
                    # each call takes the next copy (cold); at most 24 calls per repetition
                    t = time_calls(lambda: call(meth, xs, copies[next(it) % ncopy][meth]), reps, min(ncopy, 24))
                    row[f"{meth}_us"] = t * 1e6
                    row[f"{meth}_GBs"] = weight_bytes(meth, one[meth]) / t / 1e9
                res["shapes"].append(row)
                print(json.dumps(row), flush=True)
            copies = one = None  # free before the next shape (the timed closures are done with them)
        # 2. all linears of one forward, in order, distinct weights
        layer = [
            (H, H, "q4_1"),
            (KV, H, "q4_1"),
            (KV, H, "q4_1"),
            (H, H, "q4_1"),
            (I, H, "q4_1"),
            (I, H, "q4_1"),
            (H, I, "q4_1"),
        ]
        ws = [random_weight(N, K, kind, g) for _ in range(LAYERS) for N, K, kind in layer]
        ws.append(random_weight(V, H, "q8_0", g))
        for M in rows:
            xin = {K: {"f32": (x := torch.randn(M, K, generator=g)), "bf16": x.to(torch.bfloat16)} for K in (H, I)}
            row = {"M": M}
            for meth in methods:

                def fwd(meth=meth):
                    for w in ws:
                        wm = w[meth]
                        K = w["ours"].K
                        call(meth, xin[K], wm)

                t = time_calls(fwd, reps, 1)
                row[f"{meth}_ms"] = t * 1e3
                row[f"{meth}_cpu_ms"] = CPU_TIMES[0] * 1e3
                row[f"{meth}_GBs"] = sum(weight_bytes(meth, w[meth]) for w in ws) / t / 1e9
            res["forward"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        if busy is not None:
            busy.terminate()
    out = ROOT / "benchmarks" / "results" / (args.out or ("kernel_bench_busy" if args.busy else "kernel_bench"))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(report(res, methods))
    print(f"wrote {out}.md/.json")


def report(res: dict, methods: list[str]) -> str:
    """Markdown tables of the results."""
    s = [
        f"# Quantized linear kernels{' (one core kept busy)' if res['busy'] else ''}",
        "",
        f"- command: `{res['command']}`",
        f"- machine: {res['machine']}",
        f"- measured read bandwidth (256 MB float32 sum): {res['read_bandwidth_GBs']:.1f} GB/s",
        "- times: min over repetitions; weights streamed from memory (not cache-hot)",
        "",
        "## All linears of one forward (30 layers + lm_head), ms",
        "",
        "| rows | "
        + " | ".join(f"{m} ms" for m in methods)
        + " | "
        + " | ".join(f"{m} GB/s" for m in methods)
        + " | "
        + " | ".join(f"{m} / ours" for m in methods if m != "ours")
        + " |",
        "|" + "---|" * (1 + 2 * len(methods) + len(methods) - 1),
    ]
    base = {r["M"]: r for r in res["forward"]}
    for r in res["forward"]:
        s.append(
            f"| {r['M']} | "
            + " | ".join(f"{r[f'{m}_ms']:.2f}" for m in methods)
            + " | "
            + " | ".join(f"{r[f'{m}_GBs']:.1f}" for m in methods)
            + " | "
            + " | ".join(f"{r[f'{m}_ms'] / r['ours_ms']:.2f}" for m in methods if m != "ours")
            + " |"
        )
    s += [
        "",
        "Process CPU time per forward (ms, all threads; less sensitive to other processes "
        "taking the cores than wall time):",
        "",
        "| rows | " + " | ".join(f"{m} CPU ms" for m in methods) + " |",
        "|" + "---|" * (1 + len(methods)),
    ]
    for r in res["forward"]:
        s.append(f"| {r['M']} | " + " | ".join(f"{r[f'{m}_cpu_ms']:.2f}" for m in methods) + " |")
    if 1 in base:
        s += [
            "",
            "Cost of M rows relative to 1 row: "
            + ", ".join(
                f"{m}: " + " ".join(f"{r['M']}:{r[f'{m}_ms'] / base[1][f'{m}_ms']:.2f}x" for r in res["forward"])
                for m in methods
            ),
        ]
    s += [
        "",
        "## Per shape, us per call (GB/s of weight bytes)",
        "",
        "| shape | rows | " + " | ".join(methods) + " |",
        "|" + "---|" * (2 + len(methods)),
    ]
    for r in res["shapes"]:
        s.append(
            f"| {r['shape']} ({r['kind']}) | {r['M']} | "
            + " | ".join(f"{r[f'{m}_us']:.0f} ({r[f'{m}_GBs']:.1f})" for m in methods)
            + " |"
        )
    return "\n".join(s) + "\n"


if __name__ == "__main__":
    main()

"""How cheap could a k-row tree-verify forward be on this CPU? Its multiply-adds at the register peaks, against the
1-row forward as measured (issue 11's "16-token forward <= 1.6x a 1-token forward on a 512-token cache").

1. Peaks: builds ``benchmarks/cpu_peak.cpp`` (g++ -march=native; AVX-512 VNNI CPUs) and runs one copy per thread at
   once, so each thread's rate is taken while the other core is busy too: vpdpbusd (int8 multiply-adds: the int4 /
   int8 GEMM tiles and the Q8_0 lm_head), vfmadd231ps (fp32: attention), vdpbf16ps where the CPU has AVX512_BF16
   (what a bf16 attention would get).
2. Work of a k-row forward, from the model's shapes: linears k x (q, k, v, o, gate, up, down) x layers and the
   lm_head k x vocab x hidden int8 multiply-adds; attention k x layers x heads x context x head_dim x 2 (scores and
   P x V) fp32 multiply-adds. Nothing else is counted (norms, RoPE, softmax, activation quantization, Python).
3. The fused forward measured at 1 and k rows (``rows_profile.profile``: interleaved, min and median, per phase).

The floor is the work at the peaks with every other cost zero: a bound no kernel reaches. Where floor(k) / the
measured 1-row forward exceeds the target, the target is below this CPU's register peak.

    python benchmarks/verify_floor.py [--weights int4] [--context 512] [--rows 16] [--reps 20]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from rows_profile import profile  # benchmarks/ is on sys.path when run as a script

import treedraft

HERE = Path(__file__).resolve().parent
PEAKS = {"vpdpbusd": r"vpdpbusd zmm, register sources: ([\d.]+) G", "fma": r"vfmadd231ps zmm: ([\d.]+) G",
         "bf16": r"vdpbf16ps zmm: ([\d.]+) G"}  # fmt: skip
RATE = {"linears": "vpdpbusd", "lm_head": "vpdpbusd", "attention": "fma"}  # the peak each part of work() runs at
LABEL = {"attention": "attention (fp32 FMA)"}


def peaks(threads: int) -> dict[str, float]:
    """G multiply-adds per second of all ``threads`` together, per instruction (each copy's best of its two rounds)."""
    with tempfile.TemporaryDirectory() as d:
        exe = Path(d) / "cpu_peak"
        subprocess.run(["g++", "-O3", "-march=native", "-o", str(exe), str(HERE / "cpu_peak.cpp")], check=True)
        procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True) for _ in range(threads)]
        outs = [p.communicate()[0] for p in procs]
    total: dict[str, float] = {}
    for name, pat in PEAKS.items():
        per = [max((float(x) for x in re.findall(pat, o)), default=0.0) for o in outs]
        if all(per):
            total[name] = sum(per)
    return total


def work(cfg, rows: int, ctx: int) -> dict[str, float]:
    """G multiply-adds of a ``rows``-row forward at a ``ctx``-token cache: int8 (linears, lm_head), fp32 (attention)."""
    H, I, L, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    layer = H * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * H * I  # q, o + k, v + gate, up, down
    return {
        "linears": rows * L * layer / 1e9,
        "lm_head": rows * cfg.vocab_size * H / 1e9,
        "attention": rows * L * cfg.num_heads * ctx * hd * 2 / 1e9,
    }


def main() -> None:
    """Print the peaks, the floor of a k-row forward per part, and the ratios against the measured 1-row forward."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--target", type=float, default=1.6, help="the k-row / 1-row ratio asked for")
    a = ap.parse_args()
    if a.weights not in ("int4", "int8"):
        raise SystemExit("--weights: int4 or int8 (the int8 multiply-add kernels this floor counts)")
    threads = torch.get_num_threads()
    pk = peaks(threads)
    if "vpdpbusd" not in pk or "fma" not in pk:
        raise SystemExit("cpu_peak found no vpdpbusd / FMA rate: this floor needs an AVX-512 VNNI CPU")
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    rec = profile(m, a.context, [1, a.rows], a.reps)
    one = min(r[0] for r in rec[1])
    k_min, k_med = min(r[0] for r in rec[a.rows]), statistics.median(r[0] for r in rec[a.rows])
    w = work(m.config, a.rows, a.context)
    floor = {part: w[part] / pk[RATE[part]] * 1e3 for part in RATE}
    med = {i: statistics.median(r[1 + i] for r in rec[a.rows]) for i in range(7)}
    quant = statistics.median(r[8] for r in rec[a.rows])  # inside the linear phases (rows_profile's note)
    measured = {"linears": med[1] + med[3] + med[4] + med[5] - quant, "lm_head": med[6], "attention": med[2]}
    print(f"cpu: {os.cpu_count()} logical CPUs, {threads} threads; peaks of all threads together (G multiply-adds/s):",
          ", ".join(f"{k} {v:.0f}" for k, v in pk.items()))  # fmt: skip
    print(f"\n{a.weights}, context {a.context}: {a.rows}-row forward, ms (measured: median of {a.reps}, per phase)")
    print("| part | G multiply-adds | floor at the peak | measured | measured / floor |")
    print("|---|---|---|---|---|")
    for part, f in floor.items():
        print(
            f"| {LABEL.get(part, part)} | {w[part]:.3f} | {f:.2f} | {measured[part]:.2f} | {measured[part] / f:.2f} |"
        )
    rest = k_med - sum(measured.values())
    total = sum(floor.values())
    print(f"| other (norms, RoPE, softmax, quantization, Python) | - | 0 | {rest:.2f} | - |")
    print(f"| **forward** | - | **{total:.2f}** | {k_med:.2f} (min {k_min:.2f}) | {k_med / total:.2f} |")
    print(f"\n1-row forward, measured min: {one:.2f} ms; the target {a.target}x of it: {a.target * one:.2f} ms")
    print(f"floor / 1-row = {total / one:.2f}x (fp32 attention)", end="")
    if "bf16" in pk:
        bf = total - floor["attention"] + w["attention"] / pk["bf16"] * 1e3
        print(f"; {bf / one:.2f}x with attention at the vdpbf16ps peak", end="")
    print(f"; measured {k_min / one:.2f}x (min / min)")


if __name__ == "__main__":
    main()

"""Cost of one sampled token's draw from a real logits row: the native sampler vs the tensor ops.

Takes the bundled model's logits at the last 64 positions of its greedy answers to three MT-Bench first turns
(teacher-forced), then times :func:`treedraft.sampling.draw` on each row with the native kernel and with the
tensor-op fallback (the kernel patched out), per sampling configuration; prints median and mean microseconds.

    python benchmarks/sampling_cost.py [--weights int4] [--prompts 3]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from unittest import mock

import torch

import treedraft
from treedraft import kernels
from treedraft.sampling import SamplingParams, draw

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def timed(rows: torch.Tensor, p: SamplingParams) -> tuple[float, float]:
    """(median, mean) microseconds of draw() over the rows."""
    ts = []
    for r in rows:
        t0 = time.perf_counter()
        draw(r, p, 0.37)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2] * 1e6, sum(ts) / len(ts) * 1e6


def main() -> None:
    """Collect the rows, time both paths per configuration."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--prompts", type=int, default=3)
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    rows = []
    for line in list(DATA.open())[1 : 1 + a.prompts]:
        q = json.loads(line)["turns"][0]
        ids = llm.encode_prompt(q) + llm.generate(q, max_new_tokens=64, drafter=None).token_ids
        with torch.inference_mode():
            logits, _ = llm.model.forward(torch.tensor([ids]), torch.arange(len(ids)), None, 0)
        rows.append(logits[0, -64:])
    rows_t = torch.cat(rows).contiguous()
    print(f"{rows_t.shape[0]} rows of {rows_t.shape[1]} logits; native kernel: {kernels.available()}")
    print("| configuration | native median / mean us | tensor ops median / mean us |")
    print("|---|---|---|")
    for p in (
        SamplingParams(0.7),
        SamplingParams(0.7, top_p=0.9),
        SamplingParams(1.0, top_p=0.95),
        SamplingParams(0.7, top_k=50),
    ):
        nat = timed(rows_t, p)
        with mock.patch.object(kernels, "sample_draw", lambda *a: None):
            ten = timed(rows_t, p)
        name = (
            f"T {p.temperature}"
            + (f", top_p {p.top_p}" if p.top_p < 1 else "")
            + (f", top_k {p.top_k}" if p.top_k else "")
        )
        print(f"| {name} | {nat[0]:.0f} / {nat[1]:.0f} | {ten[0]:.0f} / {ten[1]:.0f} |")


if __name__ == "__main__":
    main()

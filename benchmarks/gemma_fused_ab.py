"""Gemma 3 on the own runtime: decode speed of the fused native decoder against the Python path, side by side.

Each prompt runs plain greedy decoding twice in one process, once per path (``TREEDRAFT_NO_FUSED`` toggled per
run, order alternating), and the tokens/s of the decode (prefill excluded) are summed per path.

    python benchmarks/gemma_fused_ab.py [--prompts 6] [--tokens 128] [--weights int4] [--drafter none]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import treedraft
from treedraft.models import fused

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = treedraft.load("gemma-3-270m", weights=a.weights, drafter=None)
    qs = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[: a.prompts]]
    tot = {"fused": [0, 0.0], "python": [0, 0.0]}
    for i, q in enumerate(qs):
        order = ("fused", "python") if i % 2 == 0 else ("python", "fused")
        for path in order:
            os.environ[fused.ENV_DISABLE] = "1" if path == "python" else "0"
            st = llm.generate(q, raw=True, max_new_tokens=a.tokens, drafter=a.drafter).stats
            tot[path][0] += st.new_tokens
            tot[path][1] += st.t_decode
    os.environ.pop(fused.ENV_DISABLE, None)
    tps = {k: n / t for k, (n, t) in tot.items()}
    print(
        f"gemma-3-270m {a.weights}, drafter {a.drafter}, {a.prompts} prompts x {a.tokens}: decode tok/s "
        f"fused {tps['fused']:.1f}, python {tps['python']:.1f}, fused / python {tps['fused'] / tps['python']:.2f}x"
    )


if __name__ == "__main__":
    main()

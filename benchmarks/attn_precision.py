"""How much rounding attention's operands costs: teacher-forced next-token top-1 agreement with the fp32 model.

The fp32 model answers the first ``--prompts`` MT-Bench questions greedily (200 tokens); then the int4 model (and the
fp32 one) re-reads each prompt + answer in one forward with attention's operands rounded as a variant says:

    fp16kv   keys and values rounded to float16 (the int4 default's cache, --kv-dtype auto)
    bf16kv   keys and values rounded to bfloat16
    bf16qk   queries and keys rounded to bfloat16, values float16: what --attn-scores bf16 computes (the kernel sums
             the products in vdpbf16ps' order; this emulation in SDPA only rounds the operands, which is the part
             that moves the scores)
    bf16qkv  queries, keys and values rounded to bfloat16

Session 35 (16 prompts, 2,890 answer positions): int4 + fp16kv 0.9727, + bf16qk 0.9737, + bf16qkv 0.9723; fp32
weights + bf16qkv 0.9972. The int4 weights' own rounding moves ten times more tokens than any of these.

    python benchmarks/attn_precision.py [--prompts 16]
"""

from __future__ import annotations

import argparse
import json

import torch

import treedraft
from treedraft.models import llama
from treedraft.prompts import MT_BENCH_FILE, find_shared_data

ROUND = {
    None: (None, None, None),
    "fp16kv": (None, torch.float16, torch.float16),
    "bf16kv": (None, torch.bfloat16, torch.bfloat16),
    "bf16qk": (torch.bfloat16, torch.bfloat16, torch.float16),
    "bf16qkv": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200)
    a = ap.parse_args()
    fp32 = treedraft.load(drafter=None, weights="fp32")
    int4 = treedraft.load(drafter=None, weights="int4")
    qs = [json.loads(ln) for ln in find_shared_data(MT_BENCH_FILE).read_text().splitlines() if ln.strip()]
    seqs = []
    for q in qs[: a.prompts]:
        ids = fp32.encode_prompt(q["turns"][0])
        res = fp32.text.generate(ids, fp32.config(max_new_tokens=a.tokens), None)
        seqs.append((list(ids) + list(res.token_ids), len(ids)))
    orig, mode = llama.Attention._attend, {"v": None}

    def rounded(self, q, k, v, mask, start, cached):
        dq, dk, dv = ROUND[mode["v"]]
        q, k, v = (x if d is None else x.to(d).to(x.dtype) for x, d in ((q, dq), (k, dk), (v, dv)))
        return orig(self, q, k, v, mask, start, cached)

    llama.Attention._attend = rounded

    def argmaxes(llm, variant):
        mode["v"] = variant
        out = []
        with torch.inference_mode():
            for s, n in seqs:
                logits, _ = llm.model.forward(torch.tensor(s), torch.arange(len(s)))
                out.append(logits[0, n - 1 : -1].argmax(-1))
        return torch.cat(out)

    ref = argmaxes(fp32, None)
    base = argmaxes(int4, "fp16kv")
    print(f"{len(ref)} answer positions; top-1 agreement with the fp32 model")
    print("| weights | attention operands | vs fp32 | vs int4 + fp16kv |\n|---|---|---|---|")
    print(f"| int4 | fp16kv | {(base == ref).float().mean():.4f} | 1 |")
    for v in ("bf16kv", "bf16qk", "bf16qkv"):
        x = argmaxes(int4, v)
        print(f"| int4 | {v} | {(x == ref).float().mean():.4f} | {(x == base).float().mean():.4f} |")
    for v in ("fp16kv", "bf16qkv"):
        print(f"| fp32 | {v} | {(argmaxes(fp32, v) == ref).float().mean():.4f} | - |")


if __name__ == "__main__":
    main()

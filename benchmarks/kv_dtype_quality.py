"""What a float16 KV cache costs in quality: the same model decoding the same text with a float32 and a
float16 cache, teacher-forced one token at a time (the decode steps a generation runs).

Prints next-token top-1 agreement, mean KL(float32 || float16) and the largest logit change, to set
against the weight formats' own figures (benchmarks/results/quant_quality.md: int4 vs fp32 weights).

    python benchmarks/kv_dtype_quality.py [--weights int4] [--tokens 315]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from quant_quality import TEXT  # benchmarks/ is on sys.path when run as a script

import treedraft


def main() -> None:
    """Decode the text with each cache dtype and compare the logits."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--tokens", type=int, default=315, help="text tokens (the first 16 are the prefill)")
    a = ap.parse_args()
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    ids = torch.tensor(llm.tokenizer.encode(TEXT * 4))[: a.tokens]
    logits = {}
    with torch.inference_mode():
        for kv in (torch.float32, torch.float16):
            m.kv_dtype = kv
            cache, P = m.new_cache(len(ids) + 8), 16
            rows = [m.forward(ids[None, :P], torch.arange(P), cache, 0)[0][0, -1]]
            for t in range(P, len(ids) - 1):
                rows.append(m.forward(ids[None, t : t + 1], torch.tensor([t]), cache, t)[0][0, -1])
            logits[kv] = torch.stack(rows)
    a32, a16 = logits[torch.float32], logits[torch.float16]
    agree = (a32.argmax(-1) == a16.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(a16, -1), F.log_softmax(a32, -1), log_target=True, reduction="batchmean").item()
    print(
        f"{a.weights} weights, {len(a32)} scored positions (context up to {len(ids)}): top-1 agreement {agree:.4f}, "
        f"mean KL(fp32 KV || fp16 KV) {kl:.2e} nats, max |dlogit| {(a32 - a16).abs().max():.3f} "
        f"(logit std {a32.std():.2f})"
    )


if __name__ == "__main__":
    main()

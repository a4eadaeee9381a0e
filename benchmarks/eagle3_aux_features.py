"""Intermediate-layer features for an EAGLE-3-style drafter experiment (issue 12), beside an EAGLE data dir.

EAGLE-3 (Li et al., 2025) feeds its draft layer a fusion of low, middle and high target-layer features instead
of the top one alone. ``train-eagle`` data holds the top one (the final-norm hidden state f_j of row j, token
x_{j+1}); this adds, per shard, ``aux_NNNNN.safetensors`` with the residual stream after each of ``--layers``
at the same rows, by one teacher-forced forward per sequence through the PyTorch path (forward hooks), input
[x_0 = <|im_start|>, x_1 .. x_{n-1}]. Prints the final-norm features' cosine to the stored ones as a check
(the stored ones come from the fused runtime: ~0.9997). Resumable: shards already done are skipped.

    python benchmarks/eagle3_aux_features.py --data /work/eagle-s13/data --layers 2,15 [--first-token 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import treedraft


def main() -> None:
    """Write aux_NNNNN.safetensors for every shard_NNNNN.safetensors of --data."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--layers", default="2,15")
    ap.add_argument("--first-token", type=int, default=1, help="x_0 of every sequence (SmolLM2: <|im_start|> = 1)")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = [int(x) for x in a.layers.split(",")]
    llm = treedraft.load(drafter=None, weights=a.weights)
    m = llm.model
    caps: dict[int, torch.Tensor] = {}
    for i in layers:
        m.layers[i].register_forward_hook(lambda mod, args, out, i=i: caps.__setitem__(i, out))
    shards = sorted(Path(a.data).glob("shard_*.safetensors"))
    t0, rows_done = time.time(), 0
    for n, sh in enumerate(shards):
        out = sh.with_name(sh.name.replace("shard_", "aux_"))
        if out.is_file():
            continue
        f = safe_open(str(sh), "pt")
        tok, seq, hid = f.get_tensor("tokens").long(), f.get_tensor("seq"), f.get_tensor("hidden")
        aux = {i: torch.empty(len(tok), m.hidden_size, dtype=torch.float16) for i in layers}
        cos_sum = 0.0
        start = 0
        while start < len(seq):  # rows of one sequence are consecutive
            end = start + 1
            while end < len(seq) and seq[end] == seq[start]:
                end += 1
            inp = torch.cat([torch.tensor([a.first_token]), tok[start : end - 1]])[None]
            with torch.inference_mode():
                _, h = m.forward(inp, torch.arange(inp.shape[1]), logits_for=slice(-1, None))
            cos_sum += float(torch.nn.functional.cosine_similarity(h[0].float(), hid[start:end].float(), -1).sum())
            for i in layers:
                aux[i][start:end] = caps[i][0].half()
            start = end
        save_file({f"layer{i}": t for i, t in aux.items()}, str(out) + ".tmp")
        Path(str(out) + ".tmp").rename(out)
        rows_done += len(tok)
        el = time.time() - t0
        print(
            f"{n + 1}/{len(shards)} {sh.name}: {len(tok)} rows, cos to stored {cos_sum / len(tok):.5f}, "
            f"{rows_done / el:.0f} rows/s",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    main()

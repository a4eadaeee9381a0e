"""Coupled lossless rule vs recursive rejection sampling: acceptance on the real model, and the cost of a step.

1. Mean accepted length (bonus included) of the same drafter (``hybrid``: Medusa heads + prompt lookup,
   deterministic trees, no cross-request state) on a few MT-Bench first turns, sampled (T=0.7), per seed:
   the coupled rule (seeded requests) against recursive rejection sampling (verify.uses_coupling forced
   off). For deterministic drafts both take a node's children with probability p(children), so the means
   should agree within sampling noise.
2. Cost of the acceptance itself on one step's real logits (a 64-node tree of the target's own top tokens),
   interleaved repetitions: coupled (inverse CDF, one row per emitted token), rejection sampling (softmax of
   every node + a multinomial bonus), and the Gumbel-max variant of the coupled draw (V Gumbel numbers per
   emitted token), which the inverse CDF replaces.

Run: PYTHONPATH=src python benchmarks/coupled_acceptance.py [--prompts 4 --seeds 3 --tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import treedraft
from treedraft import verify
from treedraft.sampling import SamplingParams, target_probs
from treedraft.tree import TokenTree

DATA = Path("/work/shared/data/mt_bench_questions.jsonl")


def acceptance(llm, prompts: list[str], seeds: int, tokens: int) -> dict[str, list[float]]:
    """Per (prompt, seed): mean accepted length under each rule (rules interleaved)."""
    out: dict[str, list[float]] = {"coupled": [], "rejection": []}
    real = verify.uses_coupling
    for text in prompts:
        for seed in range(seeds):
            for rule in ("coupled", "rejection") if seed % 2 == 0 else ("rejection", "coupled"):
                verify.uses_coupling = real if rule == "coupled" else (lambda r, p, t=None: False)
                try:
                    res = llm.generate(text, drafter="hybrid", max_new_tokens=tokens, temperature=0.7, seed=seed)
                finally:
                    verify.uses_coupling = real
                out[rule].append(res.stats.mean_accepted_length)
    return out


def gumbel_sample(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> int:
    """The Gumbel-max coupled draw: argmax log p + G, G from a Philox stream keyed by (seed, position)."""
    g = np.random.Generator(np.random.Philox(key=seed, counter=[0, position, 0, 0])).gumbel(size=logits.shape[-1])
    return int((target_probs(logits[None], p)[0].double().log() + torch.from_numpy(g)).argmax())


def step_cost(llm, reps: int) -> dict[str, float]:
    """Median seconds of one acceptance on a 64-node tree of the target's own top tokens."""
    model, tok = llm.model, llm.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}])
    with torch.inference_mode():
        cache = model.new_cache(len(ids) + 80)
        logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids)), cache, 0, None, slice(-1, None))
        top = logits[0, -1].topk(8).indices.tolist()
        seqs = [[a, b] for a in top for b in top[:7]]  # 8 + 56 = 64 draft nodes
        tree = TokenTree.from_sequences(ids[-1], seqs, max_nodes=64)
        from treedraft.tree import full_attention_mask, tree_positions

        start = len(ids) - 1
        cache.length = start
        lg, _ = model.forward(
            torch.tensor([list(tree.tokens)]), tree_positions(tree, start, "cpu"), cache, start,
            full_attention_mask(tree, start, "cpu"),
        )  # fmt: skip
        lg = lg[0]  # (N, V)
    params = SamplingParams(temperature=0.7, seed=5)
    unseeded = SamplingParams(temperature=0.7)
    gen = torch.Generator().manual_seed(0)
    real = verify.coupled_sample
    fns = {
        "coupled": lambda: verify.accept("speculative", tree, lg, params, gen, position=len(ids)),
        "rejection": lambda: verify.accept_speculative(tree, target_probs(lg, unseeded), gen),
        "coupled-gumbel": lambda: verify.accept_coupled(tree, lg, params, 5, len(ids)),
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    emitted: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            verify.coupled_sample = gumbel_sample if k == "coupled-gumbel" else real
            try:
                t0 = time.perf_counter()
                a = f()
                times[k].append(time.perf_counter() - t0)
            finally:
                verify.coupled_sample = real
            emitted[k].append(len(a.nodes))
    return {k: statistics.median(v) for k, v in times.items()} | {
        f"{k}_tokens_per_step": statistics.mean(v) for k, v in emitted.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)  # a shared machine: compare side by side on one core
    llm = treedraft.load(weights="int4")
    prompts = [json.loads(line)["turns"][0] for line in DATA.read_text().splitlines()[: a.prompts]]
    cost = step_cost(llm, a.reps)
    acc = acceptance(llm, prompts, a.seeds, a.tokens)
    for rule, v in acc.items():
        sd = statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else 0.0
        print(
            f"mean accepted length, {rule:9s}: {statistics.mean(v):.3f} +- {sd:.3f} (runs {[round(x, 2) for x in v]})"
        )
    for k, v in cost.items():
        print(f"{k}: {v * 1e3:.3f} ms" if not k.endswith("per_step") else f"{k}: {v:.2f}")


if __name__ == "__main__":
    main()

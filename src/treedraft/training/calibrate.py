"""Hardware-aware tree choice (Medusa's greedy tree growth + a Sequoia-style latency cost model).

Node value = probability its whole path is accepted, estimated as the product of
per-depth rank accuracies acc[d][r] (head d's rank-r candidate is right). The
tree grows greedily by node value (a child's value never exceeds its parent's, so
the tree stays prefix-closed); E[accepted length] = 1 + sum of node values (the
bonus token is the 1). The size n is chosen to maximise E[len(n)] / latency(n).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence

import torch


def grow_tree(acc: Sequence[Sequence[float]], max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """Greedy tree of up to ``max_nodes`` draft nodes; returns (choices in insertion order, node values)."""
    depth, ranks = len(acc), len(acc[0])
    heap: list[tuple[float, tuple[int, ...]]] = [(-acc[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    choices, values = [], []
    while heap and len(choices) < max_nodes:
        negv, c = heapq.heappop(heap)
        v = -negv
        choices.append(c)
        values.append(v)
        if len(c) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (-(v * acc[len(c)][r]), c + (r,)))
    return choices, values


def expected_lengths(values: Sequence[float]) -> list[float]:
    """E[accepted length] for the first n nodes, n = 0 .. len(values)."""
    out = [1.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def choose_tree(acc: Sequence[Sequence[float]], latency: dict[int, float], draft_cost: float = 0.0,
                max_nodes: int = 64) -> dict:
    """Pick the tree size maximising expected tokens/s under measured latency(n_tokens) (seconds).

    latency maps a forward's token count (root included) to seconds; values between
    measured sizes are interpolated linearly.
    """
    choices, values = grow_tree(acc, max_nodes)
    lens = expected_lengths(values)
    sizes = sorted(latency)

    def lat(n: int) -> float:
        if n in latency:
            return latency[n]
        lo = max([s for s in sizes if s <= n], default=sizes[0])
        hi = min([s for s in sizes if s >= n], default=sizes[-1])
        if hi == lo:
            return latency[lo]
        return latency[lo] + (latency[hi] - latency[lo]) * (n - lo) / (hi - lo)

    best = max(range(len(choices) + 1), key=lambda n: lens[n] / (lat(n + 1) + (draft_cost if n else 0.0)))
    table = [{"nodes": n, "expected_len": lens[n], "tok_per_s": lens[n] / (lat(n + 1) + (draft_cost if n else 0))}
             for n in range(len(choices) + 1)]
    return {"choices": [list(c) for c in choices[:best]], "nodes": best, "expected_len": lens[best],
            "expected_tok_per_s": table[best]["tok_per_s"], "plain_tok_per_s": 1.0 / lat(1), "table": table}


@torch.inference_mode()
def measure_latency(model, context: int = 512, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                    reps: int = 5) -> dict[int, float]:
    """Median seconds of one forward of n tree tokens on top of a ``context``-token cache."""
    cache = model.new_cache(context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (1, context), generator=g)
    model.forward(prompt, torch.arange(context), cache, 0, logits_for=slice(-1, None))
    cache.keep(0, range(context))
    out = {}
    for n in sizes:
        toks = torch.randint(0, model.vocab_size, (1, n), generator=g)
        mask = torch.ones(n, context + n, dtype=torch.bool).tril(context) if n > 1 else None
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            model.forward(toks, torch.arange(context, context + n), cache, context, mask)
            times.append(time.perf_counter() - t)
        out[n] = sorted(times[1:])[len(times[1:]) // 2]
    return out

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

from ..interfaces import target_device


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


LATENCY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def latency_sizes(max_nodes: int, base: Sequence[int] = LATENCY_SIZES) -> list[int]:
    """Forward sizes to measure for trees of up to ``max_nodes`` tokens (root included): the
    ``base`` sizes below it, 1 and ``max_nodes`` itself, so no size used needs extrapolation."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (it counts the root), got {max_nodes}")
    return sorted({s for s in base if s < max_nodes} | {1, max_nodes})


def choose_tree(acc: Sequence[Sequence[float]], latency: dict[int, float], draft_cost: float = 0.0,
                max_nodes: int = 64) -> dict:
    """Pick the tree size maximising expected tokens/s under measured latency(n_tokens) (seconds).

    ``max_nodes`` is the tree size budget *root included*, like GenerationConfig.max_tree_nodes,
    so the chosen tree has at most ``max_nodes - 1`` draft nodes. ``latency`` maps a forward's
    token count (root included) to seconds; sizes between measured ones are interpolated linearly.
    A size outside the measured range is extrapolated linearly from the nearest two points and
    reported in ``warnings`` (measure up to ``max_nodes``: see :func:`latency_sizes`).
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1 (it counts the root), got {max_nodes}")
    if not latency:
        raise ValueError("no latency measurements")
    choices, values = grow_tree(acc, max_nodes - 1)
    lens = expected_lengths(values)
    sizes = sorted(latency)
    outside: set[int] = set()

    def lat(n: int) -> float:
        if n in latency:
            return latency[n]
        if n < sizes[0] or n > sizes[-1]:
            outside.add(n)
            pair = sizes[:2] if n < sizes[0] else sizes[-2:]
            if len(pair) < 2:
                return latency[pair[0]]
            lo, hi = pair
        else:
            lo = max(s for s in sizes if s <= n)
            hi = min(s for s in sizes if s >= n)
        return max(0.0, latency[lo] + (latency[hi] - latency[lo]) * (n - lo) / (hi - lo))

    def tok_per_s(n: int) -> float:
        t = lat(n + 1) + (draft_cost if n else 0.0)
        return lens[n] / t if t > 0 else float("inf")

    table = [{"nodes": n, "expected_len": lens[n], "tok_per_s": tok_per_s(n)} for n in range(len(choices) + 1)]
    best = max(range(len(table)), key=lambda n: table[n]["tok_per_s"])
    plain = 1.0 / lat(1)
    warnings = []
    if outside:
        warnings.append(f"latency for {sorted(outside)} tokens was extrapolated beyond the measured sizes "
                        f"{sizes[0]}..{sizes[-1]}; measure up to {max_nodes} tokens for a reliable choice")
    return {"choices": [list(c) for c in choices[:best]], "nodes": best, "tree_tokens": best + 1,
            "expected_len": lens[best], "expected_tok_per_s": table[best]["tok_per_s"],
            "plain_tok_per_s": plain, "table": table, "warnings": warnings}


@torch.inference_mode()
def measure_latency(model, context: int = 512, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
                    reps: int = 5) -> dict[int, float]:
    """Median seconds of one forward of n tree tokens on top of a ``context``-token cache."""
    dev = target_device(model)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)  # CUDA runs async: time whole kernels
    cache = model.new_cache(context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (1, context), generator=g).to(dev)
    model.forward(prompt, torch.arange(context, device=dev), cache, 0, logits_for=slice(-1, None))
    cache.keep(0, range(context))
    out = {}
    for n in sizes:
        toks = torch.randint(0, model.vocab_size, (1, n), generator=g).to(dev)
        mask = torch.ones(n, context + n, dtype=torch.bool, device=dev).tril(context) if n > 1 else None
        times = []
        for _ in range(reps + 1):
            sync()
            t = time.perf_counter()
            model.forward(toks, torch.arange(context, context + n, device=dev), cache, context, mask)
            sync()
            times.append(time.perf_counter() - t)
        out[n] = sorted(times[1:])[len(times[1:]) // 2]
    return out

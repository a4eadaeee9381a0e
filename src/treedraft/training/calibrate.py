"""Hardware-aware tree choice (Medusa's greedy tree growth + a Sequoia-style latency cost model).

Node value = probability its whole path is accepted, estimated as the product of
per-depth rank accuracies acc[d][r] (head d's rank-r candidate is right). The
tree grows greedily by node value (a child's value never exceeds its parent's, so
the tree stays prefix-closed); E[accepted length] = 1 + sum of node values (the
bonus token is the 1). The size n is chosen to maximise E[len(n)] / latency(n).
"""

from __future__ import annotations

import heapq
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..budget import interpolate
from ..interfaces import device_sync, target_device
from ..models.cache import file_key
from ..models.plan import cached_measurement, measurement_path, store_measurement

if TYPE_CHECKING:
    from ..drafters.medusa import MedusaConfig, MedusaHeads


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


def choose_tree(
    acc: Sequence[Sequence[float]],
    latency: dict[int, float],
    draft_cost: float = 0.0,
    max_nodes: int = 64,
    min_nodes: int = 0,
) -> dict:
    """Pick the tree size maximising expected tokens/s under measured latency(n_tokens) (seconds).

    ``max_nodes`` is the tree size budget *root included*, like GenerationConfig.max_tree_nodes,
    so the chosen tree has at most ``max_nodes - 1`` draft nodes. ``latency`` maps a forward's
    token count (root included) to seconds; sizes between measured ones are interpolated linearly.
    A size outside the measured range is extrapolated linearly from the nearest two points and
    reported in ``warnings`` (measure up to ``max_nodes``: see :func:`latency_sizes`).
    ``min_nodes``: the smallest tree to consider (1 for a drafter that must propose something).
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
        if n < sizes[0] or n > sizes[-1]:
            outside.add(n)
        return interpolate(latency, n)  # the row budget's rule: linear, extrapolated from the nearest two

    def tok_per_s(n: int) -> float:
        t = lat(n + 1) + (draft_cost if n else 0.0)
        return lens[n] / t if t > 0 else float("inf")

    table = [{"nodes": n, "expected_len": lens[n], "tok_per_s": tok_per_s(n)} for n in range(len(choices) + 1)]
    best = max(range(min(min_nodes, len(table) - 1), len(table)), key=lambda n: table[n]["tok_per_s"])
    plain = 1.0 / lat(1)
    warnings = []
    if outside:
        warnings.append(
            f"latency for {sorted(outside)} tokens was extrapolated beyond the measured sizes "
            f"{sizes[0]}..{sizes[-1]}; measure up to {max_nodes} tokens for a reliable choice"
        )
    return {
        "choices": [list(c) for c in choices[:best]],
        "nodes": best,
        "tree_tokens": best + 1,
        "expected_len": lens[best],
        "expected_tok_per_s": table[best]["tok_per_s"],
        "plain_tok_per_s": plain,
        "table": table,
        "warnings": warnings,
    }


LATENCY_METHOD = "min-interleaved"  # in cache keys: curves measured the older way (median per size) are re-measured


@torch.inference_mode()
def measure_latency(
    model, context: int = 512, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64), reps: int = 5
) -> dict[int, float]:
    """Seconds of one forward of n tree tokens on top of a ``context``-token cache: the fastest of ``reps``.

    The sizes are interleaved (one round times every size once; a warm-up round first), so a burst of load
    from other processes slows one round of every size rather than all reps of one size, and the minimum
    is kept: load only ever adds time, so the fastest rep is the one closest to the forward's own cost. (The
    median of consecutive reps kept whatever load a size happened to meet: a curve measured beside a test
    run read 7.6 ms for one row and 6.6 ms for eight on a machine where one row takes 2.9 ms.)
    """
    dev = target_device(model)
    sync = device_sync(dev)  # CUDA runs async: time whole kernels
    cache = model.new_cache(context + max(sizes) + 1)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (1, context), generator=g).to(dev)
    model.forward(prompt, torch.arange(context, device=dev), cache, 0, logits_for=slice(-1, None))
    cache.keep(0, range(context))
    inputs = {}
    for n in sizes:
        toks = torch.randint(0, model.vocab_size, (1, n), generator=g).to(dev)
        mask = torch.ones(n, context + n, dtype=torch.bool, device=dev).tril(context) if n > 1 else None
        inputs[n] = (toks, torch.arange(context, context + n, device=dev), mask)
    best = {n: float("inf") for n in sizes}
    for rnd in range(max(1, reps) + 1):
        for n, (toks, pos, mask) in inputs.items():
            sync()
            t = time.perf_counter()
            model.forward(toks, pos, cache, context, mask)
            sync()
            if rnd:  # round 0 warms every size up
                best[n] = min(best[n], time.perf_counter() - t)
    return best


# ---- the tree for this machine, measured at first use --------------------------------------------------
TREE_KIND = "medusa-tree"
TREE_MAX_NODES = 64  # like GenerationConfig.max_tree_nodes' default: root included
TREE_CONTEXT = 256  # cache length the latency curve is measured on


def shipped_accuracies(cfg: MedusaConfig) -> list[list[float]] | None:
    """acc[k][r] recorded with the heads (``extra.rank_accuracy``; older files: ``extra.calibration``)."""
    acc = cfg.extra.get("rank_accuracy") or (cfg.extra.get("calibration") or {}).get("rank_accuracy")
    if not acc:
        return None
    if (
        len(acc) != cfg.num_heads
        or not all(isinstance(row, list) and row for row in acc)
        or not all(isinstance(a, (int, float)) and 0.0 <= a <= 1.0 for row in acc for a in row)
    ):
        raise ValueError(
            f"rank_accuracy must be {cfg.num_heads} lists of probabilities (one per head), "
            f"got {str(acc)[:80]}; rewrite it with `treedraft train-heads`"
        )
    return [[float(a) for a in row] for row in acc]


def _target_facts(target: object) -> dict[str, Any]:
    """What about a target changes its latency: class, size, dtype, device."""
    params = list(target.parameters()) if callable(getattr(target, "parameters", None)) else []
    modules = list(target.modules()) if callable(getattr(target, "modules", None)) else []
    # the linear kernels (fp32 plan, int4/int8 pack, native) change the latency curve as much as the size does
    linears = sorted({type(m).__name__ for m in modules if "Linear" in type(m).__name__})
    # ... and so do the native linears' block formats: int4 (Q4_1 + a Q8_0 lm_head) and int8 (Q8_0) have the same
    # linear classes and parameters, and shared one curve file (each load's check found the other's curve and
    # measured again)
    packed = sorted({k for m in modules if (k := getattr(getattr(m, "packed", None), "kind_name", None))})
    fused = _fused_decode(target)
    return {
        "target": type(target).__name__,
        "params": sum(p.numel() for p in params),
        "linears": linears,
        **({"packed": packed} if packed else {}),
        "dtype": str(params[0].dtype) if params else "?",
        # the KV cache's bytes are part of every step (an fp16 cache reads half): a curve per cache dtype
        "kv_dtype": str(getattr(target, "kv_dtype", None)),
        # bf16 attention scores make multi-row steps cheaper: their own curves (float32 keys stay as they were)
        **({"bf16_scores": True} if getattr(target, "bf16_scores", False) else {}),
        "device": str(target_device(target)),
        "hidden": getattr(target, "hidden_size", None),
        "vocab": getattr(target, "vocab_size", None),
        "fused": fused,  # one native call per decode step: a much cheaper 1-token step
        # the native kernels' sources and flags: a kernel change re-measures instead of reusing a stale curve
        "kernels": _kernel_key(linears, fused),
    }


def _kernel_key(linears: list[str], fused: bool = False) -> str | None:
    """The native build's key when any linear runs native kernels or the decode step is fused (an fp32 target's
    torch Linears run kernels/f32mm.h inside the fused step); None for pure-PyTorch targets."""
    if not fused and not any("Native" in n for n in linears):
        return None
    from ..kernels._build import build_key

    return build_key()


def _fused_decode(target: object) -> bool:
    """Whether the target's decode steps run through the fused native decoder (models/fused.py)."""
    from treedraft.models import fused
    from treedraft.models.llama import Transformer

    return isinstance(target, Transformer) and fused.status(target) is None


def tree_key(target: object, heads_dir: Path, model_id: str, draft_path: str = "") -> dict[str, Any]:
    """Cache key parts of a machine tree (with :func:`~treedraft.models.plan.machine_key` added by the cache).

    draft_path: :attr:`MedusaHeads.draft_path` -- the drafting cost enters the choice of tree, and it
    differs ~30x between the native int8 copies and emulated bf16, so each path has its own tree.
    """
    p = Path(model_id)
    heads_dir = Path(heads_dir)
    return {
        "model": file_key(p) if p.is_file() else model_id,
        **_target_facts(target),
        "heads": file_key(heads_dir / "heads.safetensors"),
        "heads_json": file_key(heads_dir / "medusa.json"),
        "draft": draft_path,
        "latency": LATENCY_METHOD,
    }


@torch.inference_mode()
def measure_draft_cost(heads: MedusaHeads, reps: int = 10) -> float:
    """Seconds of one drafting step of the heads (all heads, one hidden state)."""
    w = next(heads.parameters())
    h = torch.zeros(heads.config.hidden_size, dtype=w.dtype, device=w.device)
    root = torch.tensor(0, device=w.device) if heads.config.root_conditioned else None
    sync = device_sync(w.device)
    heads.draft_logits(h, root, heads.config.num_heads)  # warm-up
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        heads.draft_logits(h, root, heads.config.num_heads)
    sync()
    return (time.perf_counter() - t) / reps


def _checked_tree(v: Any, num_heads: int) -> tuple[tuple[int, ...], ...]:
    """Choices from a cache entry; ValueError when they do not fit these heads."""
    choices = tuple(tuple(int(r) for r in c) for c in v["choices"])
    if not choices or any(not c or len(c) > num_heads or min(c) < 0 for c in choices):
        raise ValueError(f"unusable cached tree {v['choices']!r}")
    return choices


def machine_tree(
    target: object, heads: MedusaHeads, heads_dir: Path, model_id: str, max_nodes: int = TREE_MAX_NODES
) -> tuple[tuple[int, ...], ...]:
    """The Medusa tree for these heads on this machine.

    Heads whose medusa.json names ``choices`` keep them. Otherwise the tree is chosen from the
    heads' shipped rank accuracies and this machine's forward latency curve, measured once (a few
    seconds, one line on stderr) and cached per machine, model file and heads file; ``treedraft
    calibrate --write`` stores a tree there too. Heads without accuracies get () (the default tree).
    """
    if heads.config.choices:
        return heads.config.choices
    acc = shipped_accuracies(heads.config)
    if acc is None:
        return ()
    parts = tree_key(target, heads_dir, model_id, heads.draft_path)
    dev = target_device(target)

    def measure() -> dict:
        f, _ = measurement_path(TREE_KIND, parts, dev)
        print(
            f"treedraft: measuring this machine's latency to choose the Medusa tree (once; cached in {f})",
            end="",
            file=sys.stderr,
            flush=True,
        )
        t = time.perf_counter()
        room = getattr(target, "max_seq_len", None)
        context = TREE_CONTEXT if room is None else max(1, min(TREE_CONTEXT, room - max_nodes - 1))
        lat = measure_latency(target, context, sizes=latency_sizes(max_nodes), reps=5)
        draft_cost = measure_draft_cost(heads)
        res = choose_tree(acc, lat, draft_cost, max_nodes, min_nodes=1)
        print(f" ... {time.perf_counter() - t:.1f} s: {res['nodes']} draft nodes", file=sys.stderr, flush=True)
        return tree_record(res, lat, max_nodes, context, draft_cost_ms=round(draft_cost * 1000, 3))

    def stale(v: dict) -> bool:
        # chosen on a curve whose shape this machine no longer shows (budget.measured_latency's check, on the curve
        # stored with the tree): choose again
        from ..budget import curve_off

        stored = {int(k): float(t) for k, t in (v.get("latency_ms") or {}).items()}
        if 1 not in stored or not isinstance(v.get("context"), int):
            return False
        found = curve_off(target, v["context"], stored)
        if found is not None:
            print(
                f"treedraft: the cached Medusa tree was chosen on a latency curve {found[0]:.2f}x off this machine's "
                "now; choosing it again",
                file=sys.stderr,
                flush=True,
            )
        return found is not None

    return cached_measurement(TREE_KIND, parts, measure, lambda v: _checked_tree(v, heads.config.num_heads), dev, stale)


def tree_record(res: dict, latency: dict[int, float], max_nodes: int, context: int, **extra: Any) -> dict:
    """The cached form of a :func:`choose_tree` result."""
    return {
        "choices": res["choices"],
        "max_nodes": max_nodes,
        "context": context,
        "latency_ms": {str(k): round(v * 1000, 3) for k, v in latency.items()},
        "expected_len": res["expected_len"],
        "expected_tok_per_s": res["expected_tok_per_s"],
        "plain_tok_per_s": res["plain_tok_per_s"],
        **extra,
    }


def store_machine_tree(target: object, heads_dir: Path, model_id: str, record: dict, draft_path: str = "") -> Path:
    """Store a tree (``treedraft calibrate --write``) where :func:`machine_tree` looks; returns the file."""
    parts = tree_key(target, heads_dir, model_id, draft_path)
    return store_measurement(TREE_KIND, parts, record, target_device(target))

"""What the EAGLE drafter's drafting costs on this machine, measured once and cached like the latency curve.

Two numbers, as ratios to a one-row target forward: a propose that drafts depth 1 only (the commit of one
newly accepted pair, which also gives the depth-1 distribution, the top-k and the tree bookkeeping) and
each further depth (one draft forward over ``topk`` expanded rows plus its bookkeeping). The hybrid drafter
prices ``k`` EAGLE nodes with them (:meth:`EagleDrafter.draft_cost_for`), and the drafter sizes its own
trees with them, so every process on a machine gates EAGLE alike (one-off timings under load ranged widely;
see registry.draft_cost_on_curve, which does the same for the Medusa heads).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..interfaces import DraftContext, TargetModel, device_sync, target_device

EAGLE_DRAFT_COST_KIND = "eagle-draft-cost"


def timed_after_forwards(
    target: TargetModel, ids: torch.Tensor, cache: Any, context: int, n: int, call: Any
) -> tuple[list[float], list[float]]:
    """Seconds of ``n`` one-row target forwards at position ``context`` (token ``ids[:, :1]``) and of
    ``call(i)`` right after the i-th, as drafting runs in decoding (the forward's weights evict the drafter's
    from the caches); the measurement loop of the drafters' cached draft costs."""
    dev = ids.device
    sync = device_sync(dev)  # without it, a CUDA forward's kernels would be charged to the drafting that waits on them
    fwd, draft = [], []
    for i in range(n):
        t0 = time.perf_counter()
        target.forward(ids[:, :1], torch.arange(context, context + 1, device=dev), cache, context)
        sync()
        t1 = time.perf_counter()
        call(i)
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        draft.append(t2 - t1)
    return fwd, draft


def eagle_draft_costs_on_curve(
    target: TargetModel, eagle: Any, one_row_seconds: float, reps: int = 11
) -> tuple[float, float]:
    """(seconds of a depth-1 propose, seconds of each further depth) of ``eagle`` on the scale of the cached
    latency curve, whose one-row forward takes ``one_row_seconds``.

    Timed as in decoding: each propose right after a one-row forward of the target, one newly accepted token per
    step (a one-pair commit), with tree sizing off so the depths run; the fastest of ``reps`` after a warm-up,
    divided by the fastest one-row forward timed alongside, cached per machine, target and
    drafter shape (:func:`treedraft.models.plan.cached_measurement`).
    """
    from ..models.plan import cached_measurement
    from ..training.calibrate import _target_facts

    dev = target_device(target)
    c = eagle.net.config

    def measure() -> dict:
        context = max(2, min(256, getattr(target, "max_seq_len", 512) - 2 * reps - 8))
        g = torch.Generator().manual_seed(0)
        n = context + 2 * (reps + 1) + 2
        toks = torch.randint(0, target.vocab_size, (n,), generator=g).tolist()
        cache = target.new_cache(context + 2)  # type: ignore[attr-defined]
        d = eagle.for_request()  # its own draft cache; the shared per-rank acceptance is not touched below
        d.curve, d.cal.ranks = None, d.cal.ranks.copy()  # every depth runs; measuring teaches the real drafter nothing
        with torch.inference_mode():
            ids = torch.tensor([toks[:context]], device=dev)
            _, hid = target.forward(ids, torch.arange(context, device=dev), cache, 0)
            cache.keep(0, range(context))
            feats = hid.reshape(context, -1)  # (context, H) f_0 .. f_{context-1}; later steps reuse rows
            budget = 1 + max(1, c.nodes or 16)
            ctx = DraftContext(toks[: context + 1], feats[-1], budget, 2, context, feats)
            d.propose(ctx)  # the prompt's commit: not timed

            def propose(i: int) -> None:  # step i: one more accepted pair; alternately depth 1 only and 1-2
                r = context + 1 + i
                f = feats[r % context].reshape(1, -1)
                d.propose(DraftContext(toks[: r + 1], f[0], budget, 1 + i % 2, context, f))

            fwd, draft = timed_after_forwards(target, ids, cache, context, 2 * (reps + 1), propose)
        first, both = draft[0::2], draft[1::2]
        # fastest reps: load only ever adds time, and a burst in 2 of 3 reps (a test run beside this one) made a
        # median read a depth step as 285 forwards
        base = min(fwd[2:])
        one = min(first[1:]) / base
        two = min(both[1:]) / base
        return {"first": one, "depth": max(0.0, two - one)}

    def load(v: dict) -> tuple[float, float]:
        first, depth = float(v["first"]), float(v["depth"])
        if not (0.0 <= first < 100.0 and 0.0 <= depth < 100.0):
            raise ValueError(f"implausible EAGLE draft cost ratios {first}, {depth}")
        return first, depth

    key = {
        **_target_facts(target),
        "eagle_params": sum(p.numel() for p in eagle.net.parameters()),
        "draft_vocab": c.draft_vocab,
        "topk": eagle.topk,
        "native": eagle.native is not None,
        "draft_weights": eagle.draft_weights,
        "reps": reps,
    }
    first, depth = cached_measurement(EAGLE_DRAFT_COST_KIND, key, measure, load, dev)
    return first * one_row_seconds, depth * one_row_seconds

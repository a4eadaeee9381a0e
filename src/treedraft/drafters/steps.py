"""Drafting as steps, so that one draft model's forwards for several requests run as one packed forward.

A drafter that runs a draft model (``draft-model``, the draft member of ``hybrid-draft``) drafts depth by depth, one
draft forward per depth. In the batched server each request's drafter used to run its own forwards, one request after
another: at 4 concurrent fp32 requests those forwards were most of what a step spent beyond its target forward
(benchmarks/results/session33.md). Here a drafter may offer ``propose_steps(ctx)``, a generator that *yields* each
forward it needs as a :class:`DraftForward` and receives its logits; :func:`run_forwards` runs the forwards that all
requests yielded at the same point as one packed forward per draft model (``forward_packed``: each request's rows
attend only within its own cache, and with row-invariant linears and exact attention each row is bitwise what it is
alone), and :func:`drive` runs one generator alone, which is what ``propose`` does. So the trees are the same drafted
alone or side by side; only the time changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..interfaces import DraftContext, target_device

log = logging.getLogger(__name__)
_warned = False  # a failed packed forward is logged once per process

# what a stepping drafter is: it yields forwards, receives their logits, and returns its tree
Steps = Generator["DraftForward", Tensor, Any]


@dataclass
class DraftForward:
    """One draft-model forward a drafter asks for: ``tokens`` at ``positions``, written into ``cache`` at slots
    ``[start, start + rows)``, attending as ``mask`` says ((rows, start + rows) bool; None: causal). Its result is
    the rows' logits, (rows, V) float32, or the last row's only (``last_only``: (1, V))."""

    model: Any
    cache: Any
    tokens: list[int]
    positions: list[int]
    start: int
    mask: Tensor | None = None
    last_only: bool = False

    @torch.inference_mode()  # (the generator that yielded it runs in inference mode between its yields only)
    def run(self) -> Tensor:
        """This forward alone."""
        dev = target_device(self.model)
        mask = None if self.mask is None else self.mask.to(dev)
        logits, _ = self.model.forward(
            torch.tensor([self.tokens], dtype=torch.long, device=dev),
            torch.tensor(self.positions, dtype=torch.long, device=dev),
            self.cache,
            self.start,
            mask,
            slice(-1, None) if self.last_only else None,
        )
        return logits[0].float()


def _alone(job: DraftForward) -> Tensor | Exception:
    """``job``'s logits, or the exception its forward raised."""
    try:
        return job.run()
    except Exception as e:
        return e


@torch.inference_mode()  # a draft cache grown inside a generator is an inference tensor: write it in that mode
def run_forwards(jobs: list[DraftForward]) -> list[Tensor | Exception]:
    """Each job's logits, or the exception its forward raised, in order: the jobs of one model that has
    ``forward_packed`` (the own runtime) run as ONE packed forward, any other job alone. A packed forward that raises
    is run again job by job (logged once), so only the job that fails gets its error."""
    global _warned
    out: list[Tensor | Exception | None] = [None] * len(jobs)
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(id(job.model), []).append(i)
    for idx in groups.values():
        model = jobs[idx[0]].model
        packed = getattr(model, "forward_packed", None)
        if len(idx) == 1 or packed is None:
            for i in idx:
                out[i] = _alone(jobs[i])
            continue
        from ..models.kvcache import Segment

        dev = target_device(model)
        segs, want, toks, pos, r0 = [], [], [], [], 0
        for i in idx:
            j = jobs[i]
            n = len(j.tokens)
            segs.append(Segment(j.cache, j.start, n, None if j.mask is None else j.mask.to(dev)))
            want += [r0 + n - 1] if j.last_only else list(range(r0, r0 + n))
            toks += j.tokens
            pos += j.positions
            r0 += n
        try:
            logits, _ = packed(
                torch.tensor(toks, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev),
                segs,
                torch.tensor(want, dtype=torch.long, device=dev),
            )
        except Exception:
            if not _warned:
                _warned = True
                log.warning("a packed draft forward failed; running its jobs one by one", exc_info=True)
            for i in idx:
                out[i] = _alone(jobs[i])
            continue
        li = 0
        for i in idx:
            k = 1 if jobs[i].last_only else len(jobs[i].tokens)
            out[i] = logits[li : li + k].float()
            li += k
    return out  # type: ignore[return-value]


def drives_steps(propose: Any) -> Any:
    """Mark a ``propose`` that only runs its own ``propose_steps`` (:func:`drive`): the scheduler may then step it."""
    propose._drives_steps = True
    return propose


def stepping(drafter: Any) -> Any:
    """``drafter``'s ``propose_steps``, or None where it has none or where the ``propose`` it would run is not the one
    that drives them (:func:`drives_steps`): a subclass, a class patch or an instance wrapping ``propose`` means that to
    run, and its steps would bypass it."""
    steps = getattr(drafter, "propose_steps", None)
    propose = getattr(drafter, "propose", None)
    if not callable(steps) or not getattr(getattr(propose, "__func__", propose), "_drives_steps", False):
        return None
    return steps


def propose_steps(drafter: Any, ctx: DraftContext) -> Steps:
    """``drafter``'s tree for ``ctx`` as steps: its own ``propose_steps`` where it has one (:func:`stepping`), else its
    ``propose`` (no forward to share)."""
    steps = stepping(drafter)
    if steps is not None:
        return (yield from steps(ctx))
    return drafter.propose(ctx)


def drive(steps: Steps) -> Any:
    """Run a stepping drafter alone and return its result (or raise its error)."""
    ((result, error),) = drive_together([steps])
    if error is not None:
        raise error
    return result


def drive_together(
    all_steps: list[Steps], rounds: list[float] | None = None, forwards: list[int] | None = None
) -> list[tuple[Any, BaseException | None]]:
    """Run several stepping drafters side by side: at each round every one still drafting yields a forward, and the
    round's forwards run through :func:`run_forwards` (one packed forward per draft model). Returns (result, None)
    or (None, the exception it raised) per drafter, in order; one drafter's error does not stop the others.
    ``rounds``: each round's seconds are appended to it; ``forwards``: per drafter, how many forwards it asked for is
    added to it (what the batch scheduler's row budget prices drafting by)."""
    results: list[tuple[Any, BaseException | None]] = [(None, None)] * len(all_steps)
    pending: dict[int, DraftForward] = {}
    for i, g in enumerate(all_steps):
        _advance(i, g, None, pending, results, first=True)
    while pending:
        order = list(pending)
        if forwards is not None:
            for i in order:
                forwards[i] += 1
        t0 = time.perf_counter()
        logits = run_forwards([pending[i] for i in order])  # a forward's error is thrown into its own generator
        if rounds is not None:
            rounds.append(time.perf_counter() - t0)
        pending = {}
        for i, lg in zip(order, logits):
            _advance(i, all_steps[i], lg, pending, results)
    return results


def _advance(
    i: int,
    g: Steps,
    value: Tensor | BaseException | None,
    pending: dict[int, DraftForward],
    results: list[tuple[Any, BaseException | None]],
    first: bool = False,
) -> None:
    """Step generator ``i`` once (started, sent ``value``, or thrown ``value`` where its forward failed): its next
    forward into ``pending``, or its result (or error)."""
    try:
        if first:
            pending[i] = next(g)
        elif isinstance(value, BaseException):
            pending[i] = g.throw(value)
        else:
            pending[i] = g.send(value)
    except StopIteration as stop:
        results[i] = (stop.value, None)
    except Exception as e:  # this drafter alone fails
        results[i] = (None, e)

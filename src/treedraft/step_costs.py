"""Forward costs as decoding meets them: the measured latency curve's shape corrected by the steps' own timings.

The drafters size their trees on the target's latency curve (:func:`treedraft.budget.measured_latency`): every row
count timed once per round, interleaved, the fastest of a few rounds. On some CPUs a forward's cost depends on what ran
before it, and the curve's shape is not the one decoding sees. Session 41's Xeon (L3 300 MB shared, int4 weights
96 MB): a one-row forward after a pause or after multi-row forwards took 6-7 ms and fell to ~3.5 ms only after 20-30
back-to-back ones; the cached curve read 5.55 ms for one row and 6.71 ms for four (1.21x), while in decoding the
default's four-row steps took 5.1 ms against plain's one-row 3.2 ms (1.6x). Trees sized on the curve bought rows at
a fraction of their price (``benchmarks/insitu_forward.py``, ``benchmarks/results/session41.md``).

:class:`StepCosts` learns, per measured row count, the ratio of what such a step cost in decoding (its forward and its
acceptance: a tree's acceptance walk costs more than a one-row step's draw) to the curve's forward time (at that step's
context: :class:`treedraft.budget.ContextLatency`, smoothed to its lower hull), as a decayed mean of log ratios, and
gives the curve back with its shape corrected: each size's time x its ratio / the one-row ratio, smoothed to its lower
hull again (:meth:`treedraft.budget.LatencyCurve.at`: the sizers' stopping rule needs a convex curve). The one-row
point keeps the measured time,
so every cost priced on the curve's scale (EAGLE's drafting, measured against a one-row forward) stays on it; only
the relative price of extra rows changes. The paid hybrids' Medusa heads are priced by their proposes as decoding
times them, put on the curve's scale the same way (:meth:`StepCosts.draft_cost`): on session 42's Xeon a propose cost
0.17 one-row forwards inside decoding where the cached measurement said 0.05. A drafter that always drafts never runs
a one-row step, so the scheduler asks :meth:`StepCosts.explore_due` and verifies the root alone (no drafting) for
:data:`EXPLORE_BURST` steps in a row once every :data:`EXPLORE_WARM` steps until the one-row ratio has
:data:`MIN_WEIGHT` observations, then once every :data:`EXPLORE_EVERY`: such a step still yields its token at plain
decoding's rate, so it costs at most the difference between the two rates on three steps in 64.

The one-row point is the price of not drafting, and that is what a run of one-row steps pays: only a one-row step right
after another one is its observation (session 43). On session 43's Xeon (after the thread pool's idle-wait fix,
``kernels/pool.h``) a one-row step right after tree steps cost 4.0-4.5 ms while plain decoding's took 3.4-3.5 and a
one-row step after a one-row one 3.5: an anchor taken from single exploration steps between trees made every tree look
cheaper than it is, and the default drafted its Medusa heads' node on most steps where that node's 1.39 tokens per
5.7 ms step trailed plain's 1 per 3.4 ms (``benchmarks/learned_costs_ab.py --compare anchor``).

Only steps that verify one request's tree alone (no other request's rows, no prefill chunk in the forward) are
observed, only for a request whose drafter sizes its trees on the learned curve (:func:`learner_of`), and not for
one with a grammar, penalties or logprobs (their acceptance costs are the request's own); a one-row step only when
its drafter was asked (or it was an exploration step): a backoff pause's back-to-back one-row forwards are another
regime. A seeded request under typical acceptance (its draws depend on its trees) gets no exploration steps; its
trees are still sized on the learned curve, so like the measured curve it can change its text from run to run
(``TREEDRAFT_LEARN_COSTS=0`` fixes the sizing to the cached curve). ``TREEDRAFT_LEARN_COSTS=0`` turns it all off (the
curve as measured, no exploration steps).
"""

from __future__ import annotations

import math
import os
import statistics
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

MIN_WEIGHT = 4.0  # observations before a size's ratio is used (the one-row ratio: before any correction is made)
ALPHA = 1.0 / 16  # weight of a new observation once a size has 1 / ALPHA of them (a running mean before)
MAX_STEP = math.log(2.0)  # an observation moves a warmed-up size's log ratio by at most this (a paused step)
DRAFT_RETIME = 32  # a paid member priced out by its learned cost is priced as measured once per this many asks
UPDATE_EVERY = 8  # observations between two looks at the corrected shape
SHAPE_RTOL = 0.02  # a new version (the drafters' curves and tables rebuilt, ~0.1 ms each) only when it moved this much
EXPLORE_WARM = 8  # a one-row step at least this often until the one-row ratio is known
EXPLORE_EVERY = 64  # then at least this often
EXPLORE_BURST = 3  # one-row steps in a row per exploration (only those after a one-row step are the anchor)
RATIO_RANGE = (0.5, 4.0)  # bounds of a size's corrected / measured shape


def learning_enabled() -> bool:
    """False when ``TREEDRAFT_LEARN_COSTS`` is 0/false/no/off (the measured curve is used as it is)."""
    return os.environ.get("TREEDRAFT_LEARN_COSTS", "1").strip().lower() not in {"0", "false", "no", "off"}


class StepCosts:
    """The forward's cost by rows as decoding meets it, learned over a measured ``prior`` curve (rows -> seconds, a
    plain mapping or a :class:`treedraft.budget.ContextLatency`); see the module docstring."""

    def __init__(self, prior: Mapping[int, float]) -> None:
        pts = sorted(int(n) for n in prior)
        if not pts or pts[0] != 1:
            raise ValueError(f"the latency curve needs the one-row forward, got sizes {pts}")
        self.prior = prior
        self.sizes = np.array(pts, dtype=np.float64)
        self.log_ratio = np.zeros(len(pts))
        self.weight = np.zeros(len(pts))
        self.version = 0  # bumped when the corrected shape changes (curves rebuild their tables)
        self.enabled = learning_enabled()
        self._pending = 0
        self._since_one = 0  # observed steps since the last one-row one taken as the anchor
        self._burst = 0  # exploration steps still due in the current burst
        self._last_rows = 0  # rows of the last observed step
        # the one-row anchor from one-row steps after a one-row step only (False: any one-row step; A/B benchmarks)
        self.sustained_anchor = True
        self._shape: np.ndarray | None = None  # corrected / measured, per size; None: not known yet
        self._measured: Any = None  # the prior as a budget.LatencyCurve (built at first use)
        self._drafting: dict[str, list[float]] = {}  # member name -> [observations, mean seconds, asks since timed]
        self._first_drafts: dict[str, list[float]] = {}  # a member's first MIN_WEIGHT proposes (their median starts it)

    # -- learning -------------------------------------------------------------------------------------------
    def _prior_at(self, context: int) -> Any:
        """The measured curve at ``context`` (smoothed as the drafters' curves are, so the ratios learned are to what
        they price on; its per-context curves cached by :meth:`treedraft.budget.LatencyCurve.at`)."""
        if self._measured is None:
            from .budget import LatencyCurve

            self._measured = LatencyCurve(self.prior, learned=False)
        return self._measured.at(context)

    def observe(self, rows: int, context: int, seconds: float) -> None:
        """A step of ``rows`` rows on a ``context``-token cache took ``seconds`` inside decoding (its forward and its
        acceptance; its drafting is priced apart)."""
        if not self.enabled or rows < 1 or not seconds > 0:
            return
        after, self._last_rows = self._last_rows, rows
        if rows == 1 and after != 1 and self.sustained_anchor:
            return  # a one-row step right after a tree: not what decoding without drafts pays (module docstring)
        expected = float(self._prior_at(context)(rows))
        if not expected > 0:
            return
        x = math.log(seconds / expected)
        i = int(np.searchsorted(self.sizes, rows))
        if i < len(self.sizes) and self.sizes[i] == rows:
            parts = [(i, 1.0)]
        elif i == 0 or i >= len(self.sizes):
            parts = [(min(i, len(self.sizes) - 1), 1.0)]
        else:  # between two measured sizes: shared by distance
            lo, hi = self.sizes[i - 1], self.sizes[i]
            parts = [(i - 1, (hi - rows) / (hi - lo)), (i, (rows - lo) / (hi - lo))]
        for j, w in parts:
            if w <= 0:
                continue
            n = self.weight[j]
            if n >= MIN_WEIGHT:  # warmed up: a paused or preempted step moves it only so far
                x_j = min(max(x, self.log_ratio[j] - MAX_STEP), self.log_ratio[j] + MAX_STEP)
            else:
                x_j = x
            self.weight[j] = n + w
            rate = max(w / self.weight[j], ALPHA * w)
            self.log_ratio[j] += rate * (x_j - self.log_ratio[j])
        self._since_one = 0 if rows == 1 else self._since_one + 1
        self._pending += 1
        if self._pending >= UPDATE_EVERY:
            self._pending = 0
            self._refresh()

    def saw(self, rows: int) -> None:
        """A forward of ``rows`` rows that is not an observation (batched, a prefill chunk, a backoff pause, another
        request's): what the next observed step comes after (a one-row step after a one-row pause is an anchor)."""
        self._last_rows = int(rows)

    def observe_draft(self, name: str, seconds: float) -> None:
        """A paid drafter ``name`` (the hybrid's Medusa heads) took ``seconds`` to propose inside decoding."""
        if not self.enabled or not seconds > 0:
            return
        got = self._drafting.get(name)
        if got is None:  # the first few: their median starts the mean (one slow first propose is not the price)
            first = self._first_drafts.setdefault(name, [])
            first.append(seconds)
            if len(first) >= MIN_WEIGHT:
                # statistics.median, not np.median: numpy's first median imports numpy.ma (~80 ms, in the middle of
                # a request's decoding on session 43's Xeon)
                self._drafting[name] = [float(len(first)), float(statistics.median(first)), 0.0]
                del self._first_drafts[name]
            return
        n, mean, _ = got
        seconds = min(seconds, 2.0 * mean)  # a preempted propose moves it only so far
        got[0] = n + 1
        got[1] = mean + max(1.0 / got[0], ALPHA) * (seconds - mean)
        got[2] = 0.0

    def draft_cost(self, name: str) -> float | None:
        """``name``'s propose on the measured curve's scale (seconds x the curve's one-row time / decoding's), as
        decoding met it: what the hybrid weighs against the rows its nodes would add; None until known."""
        got = self._drafting.get(name)
        if not self.enabled or got is None or self.weight[0] < MIN_WEIGHT:
            return None
        got[2] += 1
        if got[2] >= DRAFT_RETIME:  # not timed for a while (priced out?): the measured price once, to be timed again
            got[2] = 0.0
            return None
        return got[1] * math.exp(-self.log_ratio[0])

    def one_row_seconds(self, context: int) -> float | None:
        """What a one-row step (forward and acceptance) costs in decoding at ``context``, as the anchor learned it (a
        one-row step after a one-row step: plain decoding's regime); None until known or with learning off."""
        if not self.enabled or self.weight[0] < MIN_WEIGHT:
            return None
        return float(self._prior_at(context)(1)) * math.exp(float(self.log_ratio[0]))

    def explore_due(self) -> bool:
        """Whether the next observed step should verify the root alone (a one-row step: the anchor of the shape)."""
        if not self.enabled:
            return False
        if self._burst > 0:
            self._burst -= 1
            return True
        every = EXPLORE_EVERY if self.weight[0] >= MIN_WEIGHT else EXPLORE_WARM
        if self._since_one >= every - 1:
            self._burst = (EXPLORE_BURST if self.sustained_anchor else 1) - 1
            return True
        return False

    def _refresh(self) -> None:
        shape = self.shape()
        if shape is None and self._shape is None:
            return
        if shape is not None and self._shape is not None and np.allclose(shape, self._shape, rtol=SHAPE_RTOL, atol=0.0):
            return
        self._shape = shape
        self.version += 1

    def shape(self) -> np.ndarray | None:
        """Per measured size, decoding's time / the curve's, relative to the one-row point's: sizes with too few
        observations interpolated between their known neighbours (beyond the largest known one: its value); None
        until the one-row point and one other size are known."""
        known = self.weight >= MIN_WEIGHT
        if not known[0] or known.sum() < 2:
            return None
        rel = np.exp(self.log_ratio - self.log_ratio[0])
        xs, ys = self.sizes[known], rel[known]
        out = np.interp(self.sizes, xs, ys)  # (np.interp holds the end values beyond the known range)
        return np.clip(out, *RATIO_RANGE)

    def set_enabled(self, on: bool) -> None:
        """Learn and apply (True) or leave the curve as measured (False); what was learned is kept (benchmarks
        compare both in one process)."""
        self.enabled = bool(on)
        self.version += 1

    # -- use --------------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether :meth:`adjust` changes a curve (learning on and a shape known)."""
        return self.enabled and self._shape is not None

    def adjust(self, latency: Mapping[int, float]) -> dict[int, float]:
        """``latency`` (rows -> seconds, this curve's sizes or some of them) with the learned shape; as it is while
        none is known or learning is off."""
        out = {int(n): float(t) for n, t in latency.items()}
        if not self.active:
            return out
        assert self._shape is not None
        scale = np.interp(np.array(list(out), dtype=np.float64), self.sizes, self._shape).tolist()
        return {n: t * f for (n, t), f in zip(out.items(), scale)}


def learner_of(drafter: Any) -> StepCosts | None:
    """The learner a drafter's tree sizing reads (its curve's, a hybrid's members' too), else None: a drafter that
    does not size on the learned curve gains nothing from one-row steps taken for it."""
    for d in (drafter, *(getattr(drafter, "drafters", None) or ())):
        got = getattr(getattr(d, "latency", None), "learned", None)
        if got is None:
            got = getattr(getattr(d, "curve", None), "_learned", None) or getattr(
                getattr(d, "_curve", None), "_learned", None
            )
        if isinstance(got, StepCosts):
            return got
    return None


_learned: weakref.WeakKeyDictionary[Any, StepCosts] = weakref.WeakKeyDictionary()


def step_costs_for(model: Any, prior: Mapping[int, float]) -> StepCosts:
    """The model's learner (one per target model and process, shared by every drafter sized on its curve): kept
    while its prior is the same curve, a new one when the curve was measured again."""
    got = _learned.get(model)
    same = (
        got is not None
        and dict(got.prior) == dict(prior)
        and getattr(got.prior, "long", None) == getattr(prior, "long", None)
    )
    if not same:
        got = _learned[model] = StepCosts(prior)
    return got


def step_costs_of(model: Any) -> StepCosts | None:
    """The model's learner, if a drafter sized on its measured curve made one (else None: nothing to learn for)."""
    try:
        return _learned.get(model)
    except TypeError:  # not weak-referenceable: never had one
        return None

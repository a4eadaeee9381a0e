"""Per-step draft rows for a batch: give tree nodes to the requests whose drafts get accepted, when they pay.

On a CPU a forward's cost grows with its rows (``latency``: the calibrated curve, rows -> seconds): with
one request extra tree rows are nearly free, with eight they are not. Each decoding request contributes its
root row and gives one token whatever happens; a draft node adds a row and gives one more token when it
lies on the accepted path. So a step's expected yield is ``sum over requests of (1 + sum of its nodes'
acceptance probabilities)``, its cost ``latency(rows) + drafting``, and the batch's throughput is their
ratio. :class:`RowBudget` estimates, per request and per node position of its drafter's tree (the node
order the drafter chose, best first), the probability that the node is on the accepted path, from that
request's recent steps (decayed counts, shrunk toward the pool of all requests), and picks the nodes that
maximise expected tokens per second: the most probable nodes first over all requests, as many as raise the
ratio (cf. the latency-aware tree sizing of Sequoia, Chen et al. 2024, and SpecInfer's batched token trees;
here applied across requests).

Drafting is priced as measured: per count of drafting requests, and for drafters that run a draft model, per round of
packed draft forwards (:mod:`.drafters.steps`: one round per depth, shared by every request drafting with that model),
so a chain is priced by its depth.

A request that got no draft rows for ``probe_every`` steps, and a new request at its first step, gets a few
nodes (a probe), so a request that repeats known text (a suffix-drafter match, which leads the hybrid's
tree once it expects 2 or more tokens) is noticed; one accepted probe is enough for its next steps to draft. Budgets never change a greedy or seeded-coupled
request's tokens, only how many steps they take.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POSITIONS = 64  # node positions tracked per request (root excluded)
DECAY = 0.85  # weight of a step's evidence after each later step of the same request
PRIOR_WEIGHT = 0.5  # pseudo-observations of the pool's estimate in a request's own estimate
UNSEEN_FALLOFF = 0.9  # prior of a position no request has drafted yet, relative to the position before it
POOL_DECAY = 0.98
PROBE_EVERY = 64
# the wait for a probe doubles per missed draft step, up to probe_every x 2^2 = 256 steps (a 256-token request
# is then probed twice, not four or five times; a longer one that starts repeating known text is still found)
PROBE_BACKOFF = 2
DRAFTING_CAP = 4.0  # a step's drafting is taken as at most this many one-row target forwards (more is a catch-up)
PROBE_NODES = 3  # draft nodes of a probe: enough for a scored drafter (suffix) to lead the hybrid's tree
TABLE_ROWS = 1024  # the curve is tabulated up to this many rows
MIN_P = 0.02  # positions less likely than this are not candidates
OVERHEAD_DECAY = 0.8  # weight of the previous estimate of a step's cost beyond the curve
OVERHEAD_OUTLIER = 4.0  # a step period above this many times the curve's forward is not evidence (a pause)


def _prior(j: int) -> float:
    """Initial pool estimate for node position j (1-based): a modest drafter, decaying with position."""
    return 0.6 * 0.85 ** (j - 1)


@dataclass
class NodeStats:
    """Decayed counts of 'node position j was on the accepted path' over steps that drafted position j."""

    hits: list[float] = field(default_factory=lambda: [0.0] * (POSITIONS + 1))
    tries: list[float] = field(default_factory=lambda: [0.0] * (POSITIONS + 1))
    idle: int = 1 << 30  # steps since this request last got a draft row (a new request is probed at once)
    misses: int = 0  # draft steps in a row of which no node was accepted (each doubles the wait for a probe)
    # decayed counts of "node position j needed a draft-model forward", over the same steps as ``tries``: a draft model
    # drafts one forward per depth and puts its chain first, so a tree that took f forwards needed one for positions
    # 1..f (a suffix chain that led, Medusa heads: none)
    rounds: list[float] = field(default_factory=lambda: [0.0] * (POSITIONS + 1))

    def observe(self, tree_size: int, accepted: Sequence[int], decay: float, forwards: int = 0) -> None:
        """One verify step: nodes 1..tree_size-1 were drafted (with ``forwards`` draft-model forwards), ``accepted``
        (node ids, root first) won."""
        on_path = set(accepted)
        for j in range(1, min(tree_size, POSITIONS + 1)):
            self.hits[j] = self.hits[j] * decay + (j in on_path)
            self.tries[j] = self.tries[j] * decay + 1.0
            self.rounds[j] = self.rounds[j] * decay + (j <= forwards)


def interpolate(latency: dict[int, float], rows: int) -> float:
    """Seconds of a forward of ``rows`` rows: linear between measured sizes, linear extrapolation beyond."""
    xs = sorted(latency)
    if rows in latency:
        return latency[rows]
    if len(xs) == 1:
        return latency[xs[0]] * rows / xs[0]
    i = bisect.bisect_left(xs, rows)
    lo, hi = (xs[-2], xs[-1]) if i >= len(xs) else (xs[0], xs[1]) if i == 0 else (xs[i - 1], xs[i])
    t = latency[lo] + (latency[hi] - latency[lo]) * (rows - lo) / (hi - lo)
    return max(t, latency[xs[0]] * 0.5)


class RowBudget:
    """Chooses each decoding request's tree size for one step from the latency curve and acceptance history."""

    def __init__(self, latency: dict[int, float], probe_every: int = PROBE_EVERY) -> None:
        if 1 not in latency or any(t <= 0 for t in latency.values()):
            raise ValueError(f"the latency curve needs the one-row forward and positive times, got {latency}")
        self.latency = {int(k): float(v) for k, v in latency.items()}
        self.probe_every = probe_every
        self.pool = NodeStats()
        self.draft_cost = 0.0  # seconds per propose (decayed mean over the batch's proposals)
        # seconds a step's drafting took, by how many requests drafted in it (decayed means): requests drafting with
        # one draft model share its packed forwards (drafters.steps), so d drafting requests cost far less than d
        # times one; drafters that do not pack cost about d times one. What allocate() prices d drafting requests at.
        self.drafting: dict[int, float] = {}
        # seconds of one round of packed draft-model forwards (drafters.steps: every drafting request's forward at one
        # depth), decayed mean: a step drafting chains of depth J runs J such rounds whatever the count, so where
        # rounds are measured the count table above holds the rest of drafting only
        self.round_cost = 0.0
        # seconds a batched step costs beyond the curve's forward of its rows (decayed mean, >= 0): the curve is
        # one request's forward at a 256-token context; a batch adds per-request work that draft rows do not change
        # (each request's own keys/values read by attention, acceptance, streaming, the Python around the step)
        self.overhead = 0.0
        self._overhead_seen = False
        self._table = [interpolate(self.latency, max(1, r)) for r in range(TABLE_ROWS)]  # rows -> seconds
        self._pool_est: list[float] | None = None  # the pool's estimates, recomputed after it changes

    def observe_drafting(self, requests: int, seconds: float, rounds: int = 0, round_seconds: float = 0.0) -> None:
        """A step in which ``requests`` requests drafted, taking ``seconds`` of drafting in all, ``round_seconds`` of
        it in ``rounds`` rounds of packed draft-model forwards."""
        if requests < 1:
            return
        if rounds > 0:
            per = round_seconds / rounds
            if self.round_cost > 0:
                per = min(per, 2.0 * self.round_cost)  # (one slow round moves it at most to twice what it was)
            per = min(per, DRAFTING_CAP * self.seconds(1))
            self.round_cost = per if self.round_cost == 0 else 0.9 * self.round_cost + 0.1 * per
            seconds = max(0.0, seconds - round_seconds)
        # one slow step (a draft model catching up on a prompt in the step a request first drafts, a pause) moves the
        # estimate at most to twice what it was, or what the other counts say: a count priced at a prefill's cost
        # would not be chosen again, and so not measured again, for thousands of steps
        prior = self.drafting_seconds(requests)
        if prior > 0:
            seconds = min(seconds, 2.0 * prior)
        seconds = min(seconds, DRAFTING_CAP * self.seconds(1))  # (nothing measured yet: the one-row forward bounds it)
        old = self.drafting.get(requests)
        self.drafting[requests] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def drafting_seconds(self, requests: int) -> float:
        """What ``requests`` drafting requests cost a step: measured at that count, else interpolated between the
        counts measured (beyond them: on the line through the last two, or through 0 where one is known), else
        ``requests`` x :attr:`draft_cost`."""
        if requests < 1:
            return 0.0
        seen = self.drafting
        if requests in seen:
            return seen[requests]
        if not seen:
            return requests * self.draft_cost
        ds = sorted(seen)
        lo = max((d for d in ds if d < requests), default=None)
        hi = min((d for d in ds if d > requests), default=None)
        if lo is not None and hi is not None:
            return seen[lo] + (seen[hi] - seen[lo]) * (requests - lo) / (hi - lo)
        if hi is not None:  # below every measured count: through 0
            return seen[hi] * requests / hi
        if len(ds) == 1:
            return seen[lo] * requests / lo  # type: ignore[index]
        a, b = ds[-2], ds[-1]
        slope = max(0.0, (seen[b] - seen[a]) / (b - a))
        return seen[b] + slope * (requests - b)

    def seconds(self, rows: int) -> float:
        """The curve at ``rows`` rows."""
        return self._table[rows] if rows < TABLE_ROWS else interpolate(self.latency, rows)

    def _pool_estimates(self) -> list[float]:
        if self._pool_est is None:
            h, t = self.pool.hits, self.pool.tries
            self._pool_est = [1.0] + [
                (h[j] + PRIOR_WEIGHT * _prior(j)) / (t[j] + PRIOR_WEIGHT) for j in range(1, POSITIONS + 1)
            ]
        return self._pool_est

    def round_fractions(self, st: NodeStats, n: int) -> list[float]:
        """P(node position j needs a draft-model forward) for j = 1..n: the request's own rate, shrunk toward the
        pool's (a position neither has seen takes the one before it)."""
        out, last = [], 0.0
        pool_r, pool_t = self.pool.rounds, self.pool.tries
        for j in range(1, min(n, POSITIONS) + 1):
            prior = pool_r[j] / pool_t[j] if pool_t[j] >= 1.0 else last
            last = (st.rounds[j] + PRIOR_WEIGHT * prior) / (st.tries[j] + PRIOR_WEIGHT)
            out.append(last)
        return out

    def estimates(self, st: NodeStats, n: int) -> list[float]:
        """P(node position j on the accepted path) for j = 1..n, non-increasing (prefixes of the tree are kept)."""
        pool = self._pool_estimates()
        hits, tries = st.hits, st.tries
        out, last = [], 1.0
        for j in range(1, min(n, POSITIONS) + 1):
            # a position follows the request's previous one, scaled like the pool falls off where the pool has
            # seen it (else by UNSEEN_FALLOFF: a chain that is being accepted tends to go on being accepted)
            if j == 1:
                prior = pool[1]
            elif self.pool.tries[j] >= 1.0:
                prior = last * min(1.0, pool[j] / pool[j - 1])
            else:
                prior = last * UNSEEN_FALLOFF
            p = (hits[j] + PRIOR_WEIGHT * prior) / (tries[j] + PRIOR_WEIGHT)
            if p < last:
                last = p
            if last < MIN_P:
                break  # never worth a row: stop listing
            out.append(last)
        return out

    def observe(
        self,
        st: NodeStats,
        tree_size: int,
        accepted: Sequence[int],
        t_draft: float,
        pool: bool = True,
        forwards: int = 0,
    ) -> None:
        """Fold one request's verify step into its stats and (``pool``: a step sized by this budget) the pool's.
        ``forwards``: the draft-model forwards its drafter ran for the tree.

        A lone request's big trees (a Medusa tree's node 2 is node 1's sibling) say little about the small
        trees of a batch, where a node's position is mostly its depth: they are kept out of the pool."""
        if tree_size > 1:
            st.misses = 0 if len(accepted) > 1 else st.misses + 1
            st.observe(tree_size, accepted, DECAY, forwards)
            if pool:
                self.pool.observe(tree_size, accepted, POOL_DECAY, forwards)
                self._pool_est = None
            t_draft = min(t_draft, DRAFTING_CAP * self.seconds(1))  # (a first step may hold a draft's prompt catch-up)
            self.draft_cost = t_draft if self.draft_cost == 0.0 else 0.9 * self.draft_cost + 0.1 * t_draft
            st.idle = 0
        else:
            st.idle += 1

    def observe_step(self, rows: int, seconds: float) -> None:
        """One batched step of ``rows`` rows took ``seconds`` from its start to the next step's start, drafting
        excluded: fold its excess over the curve into :attr:`overhead` (what every step costs whatever its
        draft rows, so it raises the value of the tokens drafts add)."""
        curve = self.seconds(max(1, rows))
        if seconds <= 0 or seconds > OVERHEAD_OUTLIER * curve:
            return  # the worker waited or was paused: not the step's cost
        excess = max(0.0, seconds - curve)
        if not self._overhead_seen:
            self.overhead, self._overhead_seen = excess, True
        else:
            self.overhead = OVERHEAD_DECAY * self.overhead + (1.0 - OVERHEAD_DECAY) * excess

    def allocate(
        self, stats: Sequence[NodeStats], caps: Sequence[int], fixed_rows: int = 0, fixed_tokens: int = 0
    ) -> list[int]:
        """Tree size (root included) per request maximising expected tokens per second of the step.

        stats/caps: per decoding request, its history and its largest allowed tree (root included);
        fixed_rows/fixed_tokens: the step's other rows (prefill chunks, pinned trees, plain requests) and the
        tokens they give at least, which this choice does not change.
        """
        n = len(stats)
        rows, tokens = fixed_rows + n, float(n + fixed_tokens)
        # A request's nodes must be taken as a prefix of its list, and its first node also pays one propose
        # (draft_cost). Order the nodes by value per marginal second: each request's list is cut into groups of
        # non-increasing density (pool-adjacent-violators: its first node carries the propose, so a cheap chain
        # of sure nodes forms one group), groups of all requests are merged by density, and the best prefix of
        # that order is taken. With no propose cost this is "most probable nodes first"; with one, a few requests
        # draft long chains instead of every request paying a propose for one node.
        rc = max(1e-9, self.seconds(rows + 1) - self.seconds(rows))  # marginal seconds of a row, for the order only
        # draft-model rounds: a request's first k nodes need the sum of their round fractions in rounds, and the step
        # runs as many rounds as its deepest drafting request (one packed forward per depth for all of them). In the
        # order a node carries its share of a round (as if every request that drafts with a model went as deep), so
        # that requests' nodes come depth by depth; the choice below prices the rounds the chosen nodes need.
        priced = self.round_cost > 0 and n > 0  # (n = 0: every request of the step is pinned or plain)
        q = [self.round_fractions(st, cap - 1) if priced else [] for st, cap in zip(stats, caps)]
        if priced:  # the propose cost without its forwards (priced as rounds)
            propose, share = self.drafting_seconds(n) / n, self.round_cost / max(1, sum(any(qi) for qi in q))
        else:
            propose, share = self.draft_cost, 0.0
        groups: list[tuple[float, int, int, list[float]]] = []  # (-density, request, first position, values)
        ests = [self.estimates(st, cap - 1) for st, cap in zip(stats, caps)]
        for i, est in enumerate(ests):
            chain: list[list[float]] = []  # [sum p, cost, first position, *values] per group
            for j, p in enumerate(est, start=1):
                r = q[i][j - 1] * share if priced else 0.0
                chain.append([p, rc + (propose if j == 1 else 0.0) + r, j, p])
                while len(chain) >= 2 and chain[-1][0] / chain[-1][1] > chain[-2][0] / chain[-2][1]:
                    last = chain.pop()
                    chain[-1][0] += last[0]
                    chain[-1][1] += last[1]
                    chain[-1].extend(last[3:])
            groups += [(-g[0] / g[1], i, int(g[2]), g[3:]) for g in chain]
        groups.sort(key=lambda g: g[:3])  # densest first; ties: lower request, then its earlier group
        cand = [(i, j + k) for _d, i, j, vals in groups for k in range(len(vals))]
        values = [v for *_x, vals in groups for v in vals]
        drafting, fixed, rounds, need = 0, self.overhead, 0.0, [0.0] * n
        best_ratio, best_k = tokens / (self.seconds(max(1, rows)) + fixed), 0
        for k, ((i, j), p) in enumerate(zip(cand, values), start=1):
            rows += 1
            tokens += p
            drafting += j == 1
            if priced:  # (a request's nodes come in its own order: j is the next position of request i)
                need[i] += q[i][j - 1]
                rounds = max(rounds, need[i])
            ratio = tokens / (self.seconds(rows) + fixed + self.drafting_seconds(drafting) + self.round_cost * rounds)
            if ratio > best_ratio:
                best_ratio, best_k = ratio, k
        common = 0
        if priced:  # requests drafting with one draft model share its rounds: every request to one depth is tried too,
            # valued by the pool's estimates: where rows are nearly free the order above puts one request's whole chain
            # before another's first node, and one early miss kept a request from drafting (four fp32 requests drafting
            # with the target's int4 copy: ~200 -> ~218 tok/s, equal shares ~228; session 40). Each request's drafter
            # still sizes its own tree within that depth, as with equal shares.
            pool = self.estimates(NodeStats(), max(caps) - 1)  # (one list: a request's is its first cap - 1)
            r, t, d, went = fixed_rows + n, float(n + fixed_tokens), 0, [0.0] * n  # went: each request's rounds
            for depth, p in enumerate(pool, start=1):  # each depth adds one node to every request with room for it
                for i, cap in enumerate(caps):
                    if depth < cap:
                        r, t, d = r + 1, t + p, d + (depth == 1)
                        went[i] += q[i][depth - 1]
                ratio = t / (self.seconds(r) + fixed + self.drafting_seconds(d) + self.round_cost * max(went))
                if ratio > best_ratio:
                    best_ratio, common = ratio, depth
        taken = [0] * n
        for i, _j in cand[:best_k]:
            taken[i] += 1
        sizes = [1 + min(common, cap - 1) for cap in caps] if common else [1 + t for t in taken]
        for i, st in enumerate(stats):
            # (a request whose drafts keep missing is probed more rarely: on fresh text in a full batch a probe's
            # rows and propose were ~7% of the step time for nothing, benchmarks/results/session10.md)
            wait = self.probe_every << min(st.misses, PROBE_BACKOFF)
            if sizes[i] == 1 and caps[i] > 1 and st.idle >= wait:
                # probe, so the request's estimate follows what its drafter can do now
                sizes[i] = min(caps[i], 1 + PROBE_NODES)
        return sizes


class MeasuredLatency(dict):
    """rows -> seconds of a forward, as :func:`measured_latency` measured it on one context (a dict that can carry
    ``learned``: its model's :class:`treedraft.step_costs.StepCosts`)."""


class ContextLatency(dict):
    """A latency curve (rows -> seconds of a forward on a ``context``-token cache, the dict itself) that also
    knows the same forward on a longer cache (``long``, at ``long_context`` tokens), so its cost at any context
    length can be estimated: :meth:`at`.

    A tree row attends to every cached token, so its cost grows with the context while the weights' cost does
    not: on the Zen 4 of session 15 a 16-row forward cost 3.0x a 1-row one on a 256-token cache, 3.7x at 800 and
    4.3x at 1,600 (the 16-row step 11.7 -> 16.5 -> 23 ms). Trees sized by the 256-token curve were too big for
    long conversations (benchmarks/turn2_variants.py, benchmarks/results/session15.md).
    """

    def __init__(self, latency: Mapping[int, float], context: int, long: Mapping[int, float], long_context: int):
        super().__init__(latency)
        if long_context <= context:
            raise ValueError(f"long_context ({long_context}) must exceed context ({context})")
        if 1 not in long:
            raise ValueError(f"the long-context curve needs the one-row forward, got sizes {sorted(long)}")
        self.context, self.long, self.long_context = int(context), dict(long), int(long_context)

    def at(self, context: int) -> dict[int, float]:
        """rows -> seconds on a ``context``-token cache: per row count measured at both lengths, linear in the
        context through the two points (the attention part), extrapolated beyond the long one; a size whose
        longer forward measured faster (noise) keeps its short-context time.

        Never below the short-context curve: on shorter caches the measured forward gets only a little cheaper
        (16 rows: 10.1 ms at 64 tokens against 11.6 at 256), while trees sized on such a cheaper curve were
        slower in decoding (20 MT-Bench first turns, 52-138 prompt tokens: 0.996x hybrid against 1.041x on the
        256-token curve, two rounds; benchmarks/turn2_variants.py --turn 1), where a step's costs beyond the
        timed forward (mask, acceptance, drafting) weigh more."""
        out = {}
        for n, t0 in self.items():
            t1 = self.long.get(n)
            if t1 is None:
                continue
            slope = max(0.0, (t1 - t0) / (self.long_context - self.context))
            out[n] = t0 + slope * max(0, context - self.context)
        return out


CONTEXT_BUCKET = 32  # LatencyCurve.at: contexts rounded to this many tokens (one curve per bucket, cached)


class LatencyCurve:
    """Forward seconds by row count (root included), interpolated linearly between measured sizes.

    Built from a :class:`ContextLatency`, :meth:`at` gives the curve at a context length (else itself).
    """

    def __init__(self, latency: Mapping[int, float], lower_hull: bool = True, learned: bool = True) -> None:
        self._source = latency if isinstance(latency, ContextLatency) else None
        self._lower_hull = lower_hull
        self._by_context: dict[int, LatencyCurve] = {}
        # a measured curve's learner of decoding's step costs (step_costs.StepCosts): :meth:`at` applies its shape
        # (learned=False: the curve as measured, what the learner itself compares decoding's steps with)
        self._learned = getattr(latency, "learned", None) if learned else None
        pts = sorted((int(n), float(t)) for n, t in latency.items())
        self._points = dict(pts)
        self._version = -1
        if not pts or pts[0][0] != 1 or any(t <= 0 for _, t in pts):
            raise ValueError(f"the latency curve needs positive times including the one-row forward, got {pts}")
        # Load on a shared machine only ever slows a measurement down, so the curve is the *lower* convex hull
        # of the points (a forward's cost is convex in its rows: flat while the weights dominate, then linear):
        # a point above it (24 rows slower than 32) is noise. Then more rows never cost less.
        # (lower_hull=False: the points as measured, only made non-decreasing.)
        hull: list[tuple[int, float]] = []
        for q in pts:
            while lower_hull and len(hull) >= 2 and _cross(hull[-2], hull[-1], q) <= 0:
                hull.pop()
            hull.append(q)
        self.sizes = np.array([n for n, _ in hull], dtype=np.float64)
        self.times = np.maximum.accumulate(np.array([t for _, t in hull], dtype=np.float64))
        self._table: list[float] = []

    def at(self, context: int) -> LatencyCurve:
        """This curve for a forward on a ``context``-token cache (rounded to :data:`CONTEXT_BUCKET` tokens): from
        its :class:`ContextLatency`, else this curve itself (one measured context: the same curve everywhere); with
        the shape decoding's steps taught its learner (:mod:`treedraft.step_costs`), where it has one."""
        learned = self._learned
        if self._source is None and learned is None:
            return self
        version = learned.version if learned is not None else 0
        if version != self._version:  # the learned shape moved: every context's curve is built again
            self._by_context.clear()
            self._version = version
        key = 0 if self._source is None else max(0, int(context)) // CONTEXT_BUCKET * CONTEXT_BUCKET
        curve = self._by_context.get(key)
        if curve is None:
            pts = self._points if self._source is None else self._source.at(key)
            hull = self._lower_hull
            if learned is not None and learned.active:
                # the measured points smoothed as always, then decoding's shape, then smoothed again: the sizers
                # stop adding rows where one more stops paying, which finds the best tree only on a convex curve
                # (suffix_sizing.RatePricer); decoding's shape here is concave at the start (the second row dearer
                # than the next ones), and kept as met it cut second-turn trees from 3.4 to 2.0 tokens a step
                # (0.93x, session 42)
                sizes = sorted(pts)
                smooth = LatencyCurve(pts, hull)(np.array(sizes, dtype=np.float64)).tolist()
                pts = learned.adjust(dict(zip(sizes, smooth)))
            curve = object.__new__(type(self))  # the same kind of curve (a subclass's smoothing) at that context
            LatencyCurve.__init__(curve, pts, hull)
            self._by_context[key] = curve
        return curve

    def table(self, rows: int) -> list[float]:
        """[seconds for r rows, r = 0 .. rows] as a list (index 0 unused), cached: the per-step lookups."""
        if len(self._table) <= rows:
            self._table = [0.0, *self(np.arange(1, max(2 * rows, 64) + 1)).tolist()]
        return self._table

    def __call__(self, rows: np.ndarray | int) -> np.ndarray:
        """Seconds for ``rows`` rows (beyond the largest measured size: extended with its last slope)."""
        r = np.asarray(rows, dtype=np.float64)
        out = np.interp(r, self.sizes, self.times)
        if len(self.sizes) >= 2:
            slope = (self.times[-1] - self.times[-2]) / (self.sizes[-1] - self.sizes[-2])
            out = np.where(r > self.sizes[-1], self.times[-1] + max(slope, 0.0) * (r - self.sizes[-1]), out)
        return out


def _cross(a: tuple[int, float], b: tuple[int, float], c: tuple[int, float]) -> float:
    """> 0 when a -> b -> c turns left (b lies below the segment a-c)."""
    return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])


STEP_ROWS_KIND = "step-rows"
STEP_ROWS_FACTOR = 3.0  # a batched step may cost this many one-token steps
STEP_ROWS_MAX = 64


def step_rows_from_latency(latency: dict[int, float], factor: float = STEP_ROWS_FACTOR) -> int:
    """Rows per step: the largest measured forward size costing at most ``factor`` one-token forwards.

    ``latency`` maps a forward's row count to seconds (:func:`treedraft.training.calibrate.measure_latency`).
    On a CPU the cost of a forward grows slowly with its rows (weights are streamed once), so this is
    where extra rows stop being nearly free: a lone request gets a tree of up to that size, a batch of k
    shares it (k one-token rows when k exceeds it, i.e. plain decoding, batched).
    """
    if 1 not in latency:
        raise ValueError(f"the latency curve needs the one-row forward, got sizes {sorted(latency)}")
    if factor < 1:
        raise ValueError(f"factor must be >= 1, got {factor}")
    return max(n for n, t in latency.items() if t <= factor * latency[1])


SHORT_CONTEXT = 256  # the context the latency curve is measured at (less where the model's cache is smaller)
LONG_CONTEXT = 1024  # the second context the latency curve is measured at (ContextLatency)

# A cached curve is checked once per process against a few forwards timed now (CHECK_SIZES, the fastest of
# CHECK_REPS interleaved rounds, ~0.3 s for SmolLM2 on a 2-core EPYC): the tree sizing hangs on its shape, and
# a curve taken in a slow phase of a shared host, or beside a test run, stays wrong for every later process. On
# the Zen 4 EPYC one cached beside a test run read 2 / 4 / 8 rows at 1.48 / 2.08 / 2.96 one-row forwards
# against 1.05 / 1.08 / 1.59 timed later, and the default drafter then drafted 0.6 nodes a step where it drafts
# 2-3 (side by side, 12 MT-Bench x 256: second turns 1.09x, first turns 1.02-1.04x slower than with a fresh curve;
# benchmarks/curve_check_ab.py, 2026-12-03).
CHECK_SIZES = (1, 2, 4, 8)
CHECK_REPS = 4
# re-measure when some k-row / one-row ratio of the check is off the cached one by more than this factor; checks
# on a quiet machine spread by up to ~1.2x (ten checks: 4 rows 1.03-1.29, 8 rows 1.43-1.92 one-row forwards)
CHECK_TOLERANCE = 1.35
CHECK_ENV = "TREEDRAFT_CURVE_CHECK"  # "0": no check (the test suite, whose two workers share the cores)


def curve_check_enabled() -> bool:
    """Whether cached latency curves (and the trees chosen on them) are checked against this machine now."""
    return os.environ.get(CHECK_ENV, "1") != "0"


_checked: set[str] = set()  # step-rows cache files this process has checked
CHECK_CONFIRM_REPS = 8  # rounds of the second check that a disagreeing first one gets
CHECK_MIN_RATIO = 0.9  # a check that times a k-row forward below this many one-row forwards met noise: not used
_spots: dict[tuple[str, str, int], tuple[dict[int, float], float | None, bool]] = {}


def spot_check(model: Any, context: int, confirm: bool = False) -> tuple[dict[int, float], float | None]:
    """(seconds of a ``CHECK_SIZES``-row forward on a ``context``-token cache timed now, the fastest of
    ``CHECK_REPS`` interleaved rounds; other processes' most CPU use meanwhile, in cores, or None), once per
    process, cache directory, target and context. ``confirm``: ``CHECK_CONFIRM_REPS`` more rounds (once), each
    size's fastest over all of them."""
    import json

    from .models import plan
    from .training.calibrate import _target_facts, measure_latency

    key = (str(plan.cache_dir()), json.dumps(_target_facts(model), sort_keys=True, default=str), context)
    sizes = [k for k in CHECK_SIZES if k <= STEP_ROWS_MAX]
    if key not in _spots:
        window = plan.CpuWindow()
        now = measure_latency(model, context, sizes, reps=CHECK_REPS)
        _spots[key] = (now, window.others(), False)
    now, others, confirmed = _spots[key]
    if confirm and not confirmed:
        window = plan.CpuWindow()
        more = measure_latency(model, context, sizes, reps=CHECK_CONFIRM_REPS)
        o = window.others()
        now = {k: min(now[k], more[k]) for k in now}
        others = None if others is None or o is None else max(others, o)
        _spots[key] = (now, others, True)
    return now, others


def checked_disagreement(model: Any, context: int, cached: Mapping[int, float]) -> tuple[float, dict[int, float]]:
    """(:func:`curve_disagreement` of ``cached`` with this machine now, the check's curve), 1.0 where the check is
    not to be acted on: other processes busy (a measurement now would be no better), or timings that cannot be a
    forward's cost (a k-row forward under ``CHECK_MIN_RATIO`` one-row ones: the one-row rounds met a burst). A
    first check off by more than ``CHECK_TOLERANCE`` is confirmed by more rounds before it counts."""
    from .models.plan import BUSY_OTHERS

    def trusted(now: dict[int, float], others: float | None) -> bool:
        busy = others is not None and others >= BUSY_OTHERS
        return not busy and all(t >= CHECK_MIN_RATIO * now[1] for t in now.values())

    now, others = spot_check(model, context)
    if not trusted(now, others):
        return 1.0, now
    off = curve_disagreement(cached, now)
    if off > CHECK_TOLERANCE:
        now, others = spot_check(model, context, confirm=True)
        if not trusted(now, others):
            return 1.0, now
        off = curve_disagreement(cached, now)
    return off, now


def curve_off(model: Any, context: int, cached: Mapping[int, float]) -> tuple[float, dict[int, float]] | None:
    """(disagreement, the check's curve) when the curve check is on and finds ``cached`` (measured at ``context``)
    off this machine's curve now by more than ``CHECK_TOLERANCE`` (:func:`checked_disagreement`), else None."""
    if not curve_check_enabled():
        return None
    off, now = checked_disagreement(model, context, cached)
    return (off, now) if off > CHECK_TOLERANCE else None


def curve_disagreement(cached: Mapping[int, float], now: Mapping[int, float]) -> float:
    """The largest factor (>= 1) by which a k-row / one-row time ratio of ``now`` differs from ``cached``'s
    (k: the sizes of ``now`` besides 1; ``cached`` interpolated where it lacks one)."""
    worst = 1.0
    for k, t in now.items():
        if k == 1:
            continue
        a = interpolate(dict(cached), k) / cached[1]
        b = t / now[1]
        worst = max(worst, a / b, b / a)
    return worst


def measured_latency(model: Any) -> dict[int, float]:
    """This machine's forward latency curve for ``model``: seconds per row count at a :data:`SHORT_CONTEXT`-token
    context, or a shorter one where ``max_seq_len`` cannot hold that (cached apart), measured once per machine and
    model and cached; what :func:`measured_step_rows` and the drafters' sizing use.

    Where the model's cache holds well more (``max_seq_len``), the curve is also measured at
    :data:`LONG_CONTEXT` tokens and the result is a :class:`ContextLatency`: the drafters size each step's
    tree on the curve at that step's context (:meth:`LatencyCurve.at`).

    A cached curve is checked once per process (:data:`CHECK_SIZES`, :func:`curve_disagreement`): one whose
    shape no longer matches this machine is measured again (both contexts), unless other processes are
    busy now (then it is kept: a measurement under their load would be no better).
    """
    from .interfaces import target_device
    from .models.plan import cached_measurement, measurement_path
    from .step_costs import learning_enabled, step_costs_for
    from .training.calibrate import LATENCY_METHOD, _target_facts, latency_sizes, measure_latency

    room = getattr(model, "max_seq_len", 512)
    short = max(1, min(SHORT_CONTEXT, room - STEP_ROWS_MAX - 1))
    long = min(LONG_CONTEXT, room - STEP_ROWS_MAX - 1)
    dev = target_device(model)
    key = {**_target_facts(model), "latency": LATENCY_METHOD}
    if short != SHORT_CONTEXT:  # a small cache's shorter context: its own curve, never the one every other run reads
        key["context"] = short
    f = str(measurement_path(STEP_ROWS_KIND, key, dev)[0])
    replaced: list[bool] = []  # the short curve was stale: the long one, measured with it, is measured again too

    def measure(context: int = short) -> dict:
        print(
            f"treedraft: measuring this machine's forward latency at a {context}-token context for the tree sizing "
            "(once per machine and model, then cached)...",
            file=sys.stderr,
            flush=True,
        )
        lat = measure_latency(model, context, latency_sizes(STEP_ROWS_MAX), reps=5)
        return {str(k): v for k, v in lat.items()}

    def load(v: dict) -> dict[int, float]:
        lat = {int(k): float(t) for k, t in v.items()}
        if 1 not in lat:
            raise ValueError(f"the latency curve needs the one-row forward, got sizes {sorted(lat)}")
        return lat

    def stale(v: dict) -> bool:  # once per process and cache file: see CHECK_SIZES
        if f in _checked:
            return False
        _checked.add(f)
        lat = load(v)
        found = curve_off(model, short, lat)
        if found is None:
            return False
        now = found[1]
        ratios = ", ".join(
            f"{k} rows {lat[k] / lat[1]:.2f}x cached vs {now[k] / now[1]:.2f}x now" for k in now if k > 1 and k in lat
        )
        print(
            f"treedraft: the cached forward latency curve no longer matches this machine ({ratios}); measuring it again",
            file=sys.stderr,
            flush=True,
        )
        replaced.append(True)
        return True

    lat = cached_measurement(STEP_ROWS_KIND, key, measure, load, dev, stale)
    _checked.add(f)  # measured just now, or checked
    out: MeasuredLatency | ContextLatency
    if long < 2 * short:  # a small cache: one context is all there is
        out = MeasuredLatency(lat)
    else:
        at_long = cached_measurement(
            STEP_ROWS_KIND, {**key, "context": long}, lambda: measure(long), load, dev, lambda _: bool(replaced)
        )
        out = ContextLatency(lat, short, at_long, long)
    if learning_enabled():  # decoding's own step times correct the curve's shape (step_costs.py)
        out.learned = step_costs_for(model, out)
    return out


def measured_step_rows(model: Any, factor: float = STEP_ROWS_FACTOR) -> int:
    """:func:`step_rows_from_latency` on this machine's latency curve for ``model`` (measured once, cached)."""
    return step_rows_from_latency(measured_latency(model), factor)

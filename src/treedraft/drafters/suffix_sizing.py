"""How big a suffix draft should be: expected accepted tokens per unit of verify time.

The suffix index gives each draft node an *empirical* path probability (count ratios along its path).
A single earlier occurrence makes every node "certain" (1.0), which says nothing about whether the
target will repeat the passage. So each node also carries a *calibrated* acceptance probability:

    value(child) = value(parent) * h(e) * count(child) / count(parent)

where ``e = match length + depth - 1`` is how many context tokens back the continuation already
agrees at that node (the match grows by one per drafted token), and ``h(e)`` is the probability that a
continuation backed by an ``e``-token match is the target's next token. ``h`` starts from a prior per
bucket of ``e`` (1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+; measured on MT-Bench second turns with SmolLM2-135M,
benchmarks/suffix_trace.py), its failure rate scaled within a request by what the target accepted
(:class:`AcceptanceModel`): chains that keep being cut short shrink the next ones, chains accepted to
the end grow them.

The draft is then cut to the prefix (best nodes first) that maximises
``(1 + sum of values) / latency(rows)``, with ``latency`` the target's measured forward time by row
count (the same curve the Medusa tree and the batch scheduler are chosen from). This is the expected-gain
rule of Sequoia (Chen et al., 2024) and of this project's Medusa calibration, applied to SuffixDecoding's
trees (Oliaro et al., NeurIPS 2025), whose own size rule (``alpha x match length``) is kept as a cap on
the expansion: a long, confident match earns a long chain, up to where one more row costs more than it
is expected to return; a weak one earns a node or none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..budget import LatencyCurve  # one curve for the suffix, EAGLE and batch sizing
from .suffix_index import DraftPaths

# P(the target's next token = the continuation after an e-token match), by bucket of e (lower bounds):
# measured on 6 MT-Bench second turns x 128 tokens (SmolLM2-135M, greedy): 2-3: 22/39, 4-7: 35/49,
# 8-15: 58/63, 16-31: 126/131, 32-63: 204/204, 64+: 456/464; e = 1 (the plain ``suffix`` drafter's
# min_match) guessed lower. Few, correlated chains: the per-request updates correct it.
ACCEPT_PRIOR: tuple[tuple[int, float], ...] = (
    (1, 0.35),
    (2, 0.56),
    (4, 0.71),
    (8, 0.92),
    (16, 0.96),
    (32, 0.99),
    (64, 0.99),
)


@dataclass
class AcceptanceModel:
    """h(e): P(a continuation backed by an e-token match is accepted): a prior per bucket of e, its failure
    rate scaled by this request's record.

    ``1 - h(e) = kappa * (1 - prior(e))`` with ``kappa = (weight + failures seen) / (weight + failures the
    prior expected for the same nodes)``: a request whose drafts keep being accepted (a passage copied
    verbatim) earns longer chains at every match length; one whose drafts keep being cut short, shorter ones.
    """

    prior: Sequence[tuple[int, float]] = ACCEPT_PRIOR
    weight: float = 8.0  # the prior counts as this many failures' worth of evidence
    _failed: float = field(default=0.0, init=False, repr=False)
    _expected: float = field(default=0.0, init=False, repr=False)
    _table: list[float] = field(default_factory=list, init=False, repr=False)  # prior(e) by e, set in __post_init__
    _h: list[float] = field(default_factory=list, init=False, repr=False)  # h(e) by e at the current kappa ([] = stale)

    def __post_init__(self) -> None:
        lows = [b for b, _ in self.prior]
        if not lows or lows[0] != 1 or lows != sorted(set(lows)):
            raise ValueError(f"prior buckets must start at 1 and increase, got {lows}")
        if any(not 0.0 < p < 1.0 for _, p in self.prior) or self.weight <= 0:
            raise ValueError("prior probabilities must be in (0, 1) and weight > 0")
        # prior(e) for e = 0 .. the last bucket's lower bound (beyond it: the last value), looked up every step
        self._table = [self.prior[0][1]] + [
            next(q for low, q in reversed(self.prior) if e >= low) for e in range(1, lows[-1] + 1)
        ]
        self.reset()

    def reset(self) -> None:
        """Forget the outcomes (a new request): back to the prior."""
        self._failed = self._expected = 0.0
        self._h = []

    def prior_prob(self, e: int) -> float:
        """The prior h(e) of match length ``e`` (>= 1)."""
        table = self._table
        return table[min(max(e, 0), len(table) - 1)]

    @property
    def kappa(self) -> float:
        """Failures seen / failures the prior expected (smoothed by ``weight``): 1 = as the prior says."""
        return (self.weight + self._failed) / (self.weight + self._expected)

    def prob(self, e: int) -> float:
        """Current estimate of h(e)."""
        return max(0.0, 1.0 - self.kappa * (1.0 - self.prior_prob(e)))

    def probs(self, e: int, count: int) -> list[float]:
        """[h(e), h(e + 1), .., h(e + count - 1)]: :meth:`prob` of ``count`` match lengths from ``e``."""
        h = self._h
        if not h:  # h(x) for x = 0 .. the last bucket's bound at the current kappa (reset by observe)
            kappa = self.kappa
            h = self._h = [max(0.0, 1.0 - kappa * (1.0 - q)) for q in self._table]
        e = max(e, 0)
        out = h[e : e + count]
        return out + [h[-1]] * (count - len(out)) if len(out) < count else out

    def observe(self, e: int, accepted: bool) -> None:
        """One verified node backed by an e-token match: accepted or not."""
        self._expected += 1.0 - self.prior_prob(e)
        self._failed += 0.0 if accepted else 1.0
        self._h = []


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (1 = a child of the root); parents come before children."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def calibrated_values(paths: DraftPaths, model: AcceptanceModel) -> list[float]:
    """Each node's P(its whole path is accepted): count ratios times h(match + depth - 1) along the path."""
    parents, probs = paths.parents, paths.probs
    if not parents:
        return []
    # h[d - 1] = h(m + d - 1) for every depth d a node can have (called every step: no numpy)
    h = model.probs(paths.match_len, len(parents))
    vals: list[float] = []
    depth: list[int] = []
    for p, prob in zip(parents, probs):
        if p < 0:
            depth.append(1)
            vals.append(h[0] * min(1.0, prob))
            continue
        d = depth[p] + 1
        depth.append(d)
        parent_prob = probs[p]
        ratio = min(1.0, prob / parent_prob) if parent_prob > 0 else 0.0
        vals.append(vals[p] * h[d - 1] * ratio)
    return vals


def best_prefix(
    values: Sequence[float], curve: LatencyCurve, base_rows: int = 1, max_nodes: int | None = None
) -> tuple[list[int], float]:
    """(nodes to keep, their expected accepted tokens): the best-first prefix maximising tokens per second.

    ``values`` are prefix-closed path probabilities (a child never above its parent), so taking nodes in
    descending value order (ties: lower index first) always keeps a node's parent. A step of ``base_rows``
    + n rows is expected to commit 1 + sum of the n values; at most ``max_nodes`` are kept.
    """
    if not values:
        return [], 0.0
    neg = [-v for v in values]
    order = sorted(range(len(values)), key=neg.__getitem__)[:max_nodes]  # stable: ties keep the lower index first
    lat = curve.table(base_rows + len(order))
    gain, best, best_rate, best_gain = 1.0, 0, 1.0 / lat[base_rows], 1.0
    for n, i in enumerate(order, 1):
        gain += values[i]
        rate = gain / lat[base_rows + n]
        if rate > best_rate:  # strictly better: the smallest tree among equals
            best, best_rate, best_gain = n, rate, gain
    return sorted(order[:best]), best_gain - 1.0


def keep_nodes(paths: DraftPaths, keep: Sequence[int], values: Sequence[float]) -> DraftPaths:
    """The sub-tree of ``keep`` (a prefix-closed set of node indexes), ``probs`` replaced by ``values``."""
    if len(keep) == len(paths.tokens):  # every node (keep is sorted): nothing to renumber
        return DraftPaths(list(paths.tokens), list(paths.parents), [float(v) for v in values], paths.match_len)
    new = {old: i for i, old in enumerate(keep)}
    return DraftPaths(
        [paths.tokens[i] for i in keep],
        [-1 if paths.parents[i] < 0 else new[paths.parents[i]] for i in keep],
        [float(values[i]) for i in keep],
        paths.match_len,
    )


def periodic_extend(paths: DraftPaths, context: Sequence[int], start: int, max_depth: int) -> DraftPaths:
    """Continue the most recent occurrence's chain past the end of the context, into the draft itself.

    The occurrence at ``start`` (the position right after the matched suffix) predicts draft token j as
    ``ext[start + j]``, ``ext`` being the context followed by the draft; once ``start + j`` reaches the end,
    that is the draft's own token ``j - p`` (``p = len(context) - start``): the passage repeats with period p
    (a model looping on a phrase, a list continuing its pattern). The index alone stops at the end of the
    text; this adds the rest of the chain, each new node with the probability of the node it hangs under.
    Nothing is added unless the tree already holds the occurrence's continuation up to the end.
    """
    n = len(context)
    p = n - start
    if p < 1 or max_depth <= p:
        return paths
    tokens, parents, probs = list(paths.tokens), list(paths.parents), list(paths.probs)
    kids: dict[int, dict[int, int]] = {}
    for i, par in enumerate(parents):
        kids.setdefault(par, {})[tokens[i]] = i
    node = -1
    for j in range(max_depth):
        t = int(context[start + (j % p)])
        nxt = kids.get(node, {}).get(t)
        if nxt is None:
            if j < p:
                return paths  # the tree does not follow this occurrence to the end: nothing to extend
            tokens.append(t)
            parents.append(node)
            probs.append(probs[node] if node >= 0 else 1.0)
            nxt = len(tokens) - 1
            kids.setdefault(node, {})[t] = nxt
        node = nxt
    return DraftPaths(tokens, parents, probs, paths.match_len)


def expansion_cap(match_len: int, alpha: float, limit: int) -> int:
    """SuffixDecoding's adaptive size: at most ``alpha x match length`` nodes (>= 1), within ``limit``."""
    return max(0, min(limit, max(1, math.floor(alpha * match_len))))


class RatePricer:
    """:func:`best_prefix` while the tree is being expanded: ``take(value)`` says whether to add the next node.

    Offered best-first values (never increasing), the expected rate ``(1 + sum of values) / latency(rows)``
    is quasi-concave in the node count, because the gain is concave and the curve convex (:class:`LatencyCurve`
    is its measured points' lower convex hull). So once one more node lowers the rate, no later prefix can
    beat the best one: the expansion stops there instead of building nodes that are then cut. ``best`` is
    the node count with the highest rate seen (ties: the fewest), ``gain`` their summed values.
    """

    def __init__(self, curve: LatencyCurve, base_rows: int = 1, max_nodes: int = 64) -> None:
        self._lat = curve.table(base_rows + max_nodes + 1)
        self._base = base_rows
        self.n, self.best, self._sum, self.gain = 0, 0, 0.0, 0.0
        self._rate = 1.0 / self._lat[base_rows]
        self._best_rate = self._rate

    def take(self, value: float) -> bool:
        """Add a node of ``value`` (no higher than the ones before) unless it lowers the expected rate."""
        rows = self._base + self.n + 1
        if rows >= len(self._lat):
            return False
        rate = (1.0 + self._sum + value) / self._lat[rows]
        if rate < self._rate:
            return False
        self.n, self._sum, self._rate = self.n + 1, self._sum + value, rate
        if rate > self._best_rate:
            self.best, self.gain, self._best_rate = self.n, self._sum, rate
        return True

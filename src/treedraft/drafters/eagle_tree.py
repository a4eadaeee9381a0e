"""Expected-gain sizing of the EAGLE-2 dynamic tree (Li et al. 2024, arXiv:2406.16858, section 4).

EAGLE-2 observes that the draft's confidence approximates acceptance: a node's *value* is the product of
the draft probabilities along its path, an estimate of P(the target accepts it). A verified tree then
yields on average ``1 + sum(value)`` tokens (the bonus token plus every accepted node; a trie's accepted
nodes are exactly the nodes whose whole path is accepted). On a CPU the verify forward grows steeply with
its rows (this Xeon: 1/2/4/8/16 rows = 10.8/11.9/19.1/29.3/51.8 ms at 256-token context), so the tree
keeps its best N nodes where N maximises tokens per second:

    N* = argmax_N  (1 + v_1 + ... + v_N) / (latency(N + 1) + draft_time)

with v sorted descending (a child's value never exceeds its parent's, so the best N are a trie). N = 0
(plain decoding) is a candidate, so a weak draft costs its drafting time but never a bigger verify.
Drafting deeper is worth one more draft forward only while some frontier node could still add value
(:func:`worth_expanding`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..budget import LatencyCurve as _LatencyCurve


class LatencyCurve(_LatencyCurve):
    """Seconds of one target forward of n rows, linearly interpolated between measured sizes (as measured,
    made non-decreasing; no lower hull, unlike the suffix drafter's smoothing)."""

    def __init__(self, latency: Mapping[int, float]) -> None:
        super().__init__(latency, lower_hull=False)


def _best(
    values_desc: Sequence[float], lat: Sequence[float], draft_seconds: float, max_nodes: int
) -> tuple[int, float]:
    """(N in [0, max_nodes], its tokens per second): N maximising (1 + the N best values) / (lat[N + 1] +
    draft_seconds), the first maximum (the smaller tree on ties). Plain floats: the trees are a few dozen nodes,
    where each NumPy call's overhead costs more than the whole loop (this runs at every draft depth)."""
    gain, best, rate = 1.0, 0, 1.0 / (lat[1] + draft_seconds)
    for n, v in enumerate(values_desc[: max(0, max_nodes)], 1):
        gain += v
        r = gain / (lat[n + 1] + draft_seconds)
        if r > rate:
            best, rate = n, r
    return best, rate


def best_size(values_desc: Sequence[float], curve: LatencyCurve, draft_seconds: float, max_nodes: int) -> int:
    """N in [0, max_nodes] maximising (1 + sum of the N best values) / (latency(N + 1) + draft_seconds)."""
    v = [float(x) for x in values_desc]
    return _best(v, curve.table(len(v) + 1), draft_seconds, max_nodes)[0]


def choose_size(values_desc: Sequence[float], curve: LatencyCurve, draft_seconds: float) -> tuple[int, bool]:
    """(N* = :func:`best_size` over all values, whether that tree beats a plain step, which drafts nothing)."""
    v = [float(x) for x in values_desc]
    lat = curve.table(len(v) + 1)
    n, rate = _best(v, lat, draft_seconds, len(v))
    return n, bool(rate * lat[1] >= 1.0)


def worth_expanding(
    values: Sequence[float], frontier_best: float, curve: LatencyCurve, draft_seconds: float, step_seconds: float
) -> bool:
    """Whether one more draft depth can pay: the current best tree vs the same tree plus one child as likely
    as the best frontier node (an upper bound: a child's value never exceeds its parent's), paying one more
    draft forward of ``step_seconds``. ``values``: the drafted nodes' values, in any order."""
    v = sorted((float(x) for x in values), reverse=True)
    lat = curve.table(len(v) + 2)
    now = _best(v, lat, draft_seconds, len(v))[1]
    # the optimistic child joins the best tree, which may then take more of the existing nodes too
    bisect.insort(v, float(frontier_best), key=lambda x: -x)
    return _best(v, lat, draft_seconds + step_seconds, len(v))[1] > now


def accepted_nodes(tree: Any, committed: Sequence[int]) -> list[int]:
    """Ranks (node index - 1) of ``tree``'s nodes on the path the step committed: ``committed`` = the tokens after
    the root that the target accepted (the bonus token excluded)."""
    kids: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if i}
    out, node = [], 0
    for t in committed:
        node = kids.get((node, int(t)), -1)
        if node < 0:
            break
        out.append(node - 1)
    return out


def prior_values(cfg: Any, n: int) -> np.ndarray:
    """(n,) prior acceptance of the tree's nodes by rank before any tree was verified: the held-out per-depth
    top-1 of the shipped training run (eagle.json extra.training) multiplied along a chain for the first ranks,
    then halving per rank; 0.5, 0.25, ... without training facts."""
    epochs = ((getattr(cfg, "extra", None) or {}).get("training") or {}).get("epochs") or [{}]
    top1 = [float(a) for a in epochs[-1].get("heldout_top1") or [] if 0.0 <= float(a) <= 1.0]
    v, out = 1.0, []
    for j in range(n):
        v *= top1[j] if j < len(top1) else 0.5
        out.append(v)
    return np.array(out, dtype=np.float64)


class RankAcceptance:
    """How often the tree's node of each rank (best cumulative draft log-prob first) lies on the committed path,
    over recent verified trees (decayed counts per rank, only where the tree had that rank), plus a prior worth
    ``PRIOR_TREES`` trees."""

    DECAY = 0.98  # per tree that held the rank: follows roughly the last 50
    PRIOR_TREES = 4.0

    def __init__(self, size: int, prior: np.ndarray) -> None:
        if size < 1:
            raise ValueError(f"RankAcceptance needs at least one rank, got {size}")
        p = np.zeros(size)
        p[: min(size, len(prior))] = np.clip(prior[:size], 0.0, 1.0)
        self.size, self.prior = size, p
        self.hits, self.seen = np.zeros(size), np.zeros(size)

    def add(self, nodes: int, accepted: Sequence[int]) -> None:
        """One verified tree of ``nodes`` draft nodes (ranks 0 .. nodes-1), of which ranks ``accepted`` were accepted."""
        n = min(nodes, self.size)
        self.hits[:n] *= self.DECAY
        self.seen[:n] = self.DECAY * self.seen[:n] + 1.0
        for j in accepted:
            if j < n:
                self.hits[j] += 1.0

    def copy(self) -> RankAcceptance:
        """An independent copy (the same counts from here on apart)."""
        out = RankAcceptance(self.size, self.prior)
        out.hits, out.seen = self.hits.copy(), self.seen.copy()
        return out

    def values(self) -> np.ndarray:
        """(size,) expected acceptance per rank, made non-increasing (a later rank never pays more than an earlier one)."""
        w = self.PRIOR_TREES
        v = (self.hits + w * self.prior) / (self.seen + w)
        return np.minimum.accumulate(v)

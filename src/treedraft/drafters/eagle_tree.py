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
import copy
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

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


class TreeCalibration:
    """What a dynamic-tree drafter learns from its verified trees (EAGLE-2's values are the draft's own
    probabilities, not the target's: an overconfident draft gets a factor < 1), and its drafting back-off.

    ``learn`` adds the last tree's outcome (tokens committed since, the bonus excluded) against its expected value;
    :attr:`factor` is accepted draft tokens per unit of expected value over recent trees. A tree that did not beat a
    plain step (:func:`choose_size`) skips drafting for a doubling number of steps (``paid``)."""

    DECAY = 0.95  # per tree: the calibration follows roughly the last 20 trees
    PRIOR = 2.0  # pseudo-counts of a calibrated draft (factor 1) before any tree was verified
    MAX_SKIP = 8  # steps drafting is skipped after a tree that did not pay (doubling back-off)

    def __init__(self, ranks: RankAcceptance | None = None) -> None:
        self.ranks = ranks  # per-rank acceptance (the hybrid prices EAGLE's first k nodes by it); None: not kept
        self.acc = self.exp = 0.0  # decayed sums: accepted draft tokens, expected (uncalibrated) values
        self.skip = self.backoff = 0  # steps left to skip drafting; the current back-off length
        self.reset()

    def reset(self) -> None:
        """A new sequence: the last tree's outcome will never be seen."""
        # (value, root position, root token, tree, each kept node's conditional draft probability)
        self.last: tuple[float, int, int, Any, Sequence[float]] | None = None

    def fork(self) -> TreeCalibration:
        """One request's copy: this calibration's counts from here on apart, no back-off, the same ``ranks``."""
        out = copy.copy(self)
        out.skip = out.backoff = 0
        out.reset()
        return out

    @property
    def factor(self) -> float:
        """Accepted draft tokens per unit of expected draft value over recent trees."""
        return (self.acc + self.PRIOR) / (self.exp + self.PRIOR)

    def drafted(self, value: float, at: int, root: int, tree: Any, probs: Sequence[float] = ()) -> None:
        """Remember a proposed tree (its summed draft values, the root's position and token, its nodes' conditional
        draft probabilities in tree order) until its outcome."""
        self.last = (value, at, root, tree, probs)

    def child_key(self, parent_key: float, logp: float) -> float:
        """A child's ranking key from its parent's and its conditional draft log-probability: here the cumulative
        draft log-probability (EAGLE-2's)."""
        return parent_key + logp

    def value(self, key: float) -> float:
        """A node's expected acceptance from its key: the draft's path probability times :attr:`factor`, at most 1."""
        return min(1.0, self.factor * math.exp(key))

    def raw(self, key: float) -> float:
        """What :meth:`learn` compares the accepted tokens against: the draft's own path probability."""
        return math.exp(key)

    def learn(self, tokens: Sequence[int]) -> None:
        """Add the last tree's outcome, read from the sequence one step later (``tokens``: root last)."""
        if self.last is None:
            return
        value, at, root, tree, probs = self.last
        self.last = None
        r = len(tokens) - 1
        if r > at and tokens[at] == root:  # the same sequence, one step later
            hit = accepted_nodes(tree, tokens[at + 1 : r])  # this tree's nodes on the committed path
            self.acc = self.DECAY * self.acc + len(hit)  # (in a hybrid, another member's may be longer)
            self.exp = self.DECAY * self.exp + value
            if self.ranks is not None:
                self.ranks.add(len(tree) - 1, hit)
            self.tested(tree, hit, probs)

    def tested(self, tree: Any, hit: list[int], probs: Sequence[float]) -> None:
        """A verified tree's nodes (ranks ``hit`` accepted; ``probs`` their conditional draft probabilities): what a
        subclass learns per node. Nothing here."""

    def skip_step(self, can_draft: bool) -> bool:
        """Whether this step skips drafting (back-off), counting it."""
        if self.skip > 0 and can_draft:
            self.skip -= 1
            return True
        return False

    def paid(self, paid: bool) -> None:
        """The last tree beat a plain step (back-off cleared) or did not (drafting skipped, doubling)."""
        self.skip = self.backoff = 0 if paid else min(self.MAX_SKIP, max(1, 2 * self.backoff))


class ProbCalibration(TreeCalibration):
    """A :class:`TreeCalibration` that learns P(a node is accepted | its parent was, its conditional draft
    probability p) in bins of p, from every verified node whose parent was accepted; a node's value is the product
    of those along its path, and nodes are ranked by it.

    For a draft that agrees with the target far more often than its own probabilities say (a quantized copy of the
    target: its top token is the target's ~98% of the time at p ~0.6), EAGLE-2's path probability undervalues deep
    nodes geometrically and one scalar factor cannot mend that (it would overvalue the siblings); per-bin rates do.
    Before any verified node a bin's rate is its own p (a calibrated draft), worth :attr:`BIN_PRIOR` nodes. A
    :meth:`fork` shares the bins (every request's trees teach the drafter, as EAGLE's shared per-rank acceptance)."""

    BINS = 10
    BIN_PRIOR = 2.0
    BIN_DECAY = 0.995  # per verified tree: the rates follow the last few hundred trees

    def __init__(self) -> None:
        super().__init__()
        self.hits, self.seen = np.zeros(self.BINS), np.zeros(self.BINS)

    def _bin(self, p: float) -> int:
        return min(int(p * self.BINS), self.BINS - 1)

    def rate(self, p: float) -> float:
        """P(accepted | parent accepted) for a node of conditional draft probability ``p``."""
        b = self._bin(p)
        return (self.hits[b] + self.BIN_PRIOR * p) / (self.seen[b] + self.BIN_PRIOR)

    def child_key(self, parent_key: float, logp: float) -> float:
        return parent_key + math.log(max(self.rate(math.exp(logp)), 1e-12))

    def value(self, key: float) -> float:
        return math.exp(key)

    def tested(self, tree: Any, hit: list[int], probs: Sequence[float]) -> None:
        if len(probs) != len(tree) - 1:
            return
        on_path = {0} | {j + 1 for j in hit}  # node indices (root 0) the step committed
        self.hits *= self.BIN_DECAY
        self.seen *= self.BIN_DECAY
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:  # verified: its parent was accepted
                b = self._bin(probs[i - 1])
                self.seen[b] += 1.0
                self.hits[b] += float(i in on_path)


def prune_cut(score: list[float], budget: int) -> float | None:
    """The ``budget``-th best cumulative log-prob of the drafted nodes (``score[0]`` = root, excluded), None while
    at most ``budget`` are drafted. A child scores at most its parent and loses ties to it (deeper), so a
    frontier node scoring at or below this cut cannot place a child among the ``budget`` kept nodes."""
    if len(score) - 1 <= budget:
        return None
    return sorted(score[1:], reverse=True)[budget - 1]


# expand(nodes, tokens, parents, depths, start, mask) -> (len(nodes), V') float32 draft logits of those nodes' children
Expand = Callable[[list[int], list[int], list[int], list[int], int, torch.Tensor], torch.Tensor]


def grow_tree(root: int, first_logits: torch.Tensor, expand: Expand, **kwargs: Any) -> tuple[Any, float, list[float]]:
    """:func:`grow_tree_steps` with each depth's draft forward run by ``expand`` at once."""
    steps = grow_tree_steps(root, first_logits, **kwargs)
    try:
        args = next(steps)
        while True:
            args = steps.send(expand(*args))
    except StopIteration as stop:
        return stop.value


def grow_tree_steps(
    root: int,
    first_logits: torch.Tensor,
    *,
    base: int,
    budget: int,
    depth: int,
    topk: int,
    curve: LatencyCurve | None,
    cal: TreeCalibration,
    drafting_seconds: Callable[[int], float],
    vocab: np.ndarray | None = None,
    pick: Callable[[torch.Tensor, list[int]], tuple[np.ndarray, np.ndarray]] | None = None,
) -> Generator[tuple[list[int], list[int], list[int], list[int], int, torch.Tensor], torch.Tensor, Any]:
    """An EAGLE-2 dynamic tree (Li et al. 2024, section 4) -> (TokenTree, 1 + its summed draft values (``cal.raw``),
    each kept node's conditional draft probability in tree order, for ``cal.drafted``), as a generator: it yields the
    arguments of each depth's draft forward, ``(nodes, tokens, parents, depths, start, mask)`` (:data:`Expand`'s), and
    is sent that forward's logits, so the caller may run several requests' forwards together
    (:mod:`treedraft.drafters.steps`).

    Depth 1 = the top-k children of the root (``first_logits`` (1, V') float32); at every later depth the k frontier
    nodes with the highest cumulative draft log-probability are expanded in one ``expand`` call (``start``: the draft
    cache slot of its first row, ``base`` + nodes expanded so far; ``mask`` (e, start + e) bool: the committed slots,
    the node's expanded ancestors and itself), each into its top-k children; then every drafted node is reranked by
    cumulative log-probability and the best ``budget`` kept (a child never outranks its parent: a trie). With a
    ``curve`` (the target's verify seconds per row count at this context) a depth is drafted only while a frontier
    node can pay for it (:func:`worth_expanding`, at ``drafting_seconds(forwards)``, the commit being forward 1) and
    the tree keeps its best N for tokens per second (:func:`choose_size`), telling ``cal`` whether it paid.
    ``vocab``: the token id of each logits column (None: the column is the id). Ties between equal logits: the lower
    column first; between equal scores the shallower, earlier node. ``pick(logits, depths)``: the children of nodes
    at those depths instead of the top-k, as (log-probabilities (rows, k), columns (rows, k)) arrays."""
    from ..kernels import topk_rows
    from ..tree import TokenTree

    # candidate nodes (root = 0): token, parent, ranking key (cal.child_key: the cumulative log-prob for EAGLE-2),
    # depth, conditional draft log-prob; slot = draft cache slot if expanded
    tok, par, score, dep, cond = [root], [-1], [0.0], [0], [0.0]
    slot_of: dict[int, int] = {}
    anc: dict[int, list[int]] = {0: []}  # draft cache slots of a node's expanded proper ancestors

    def children(nodes: list[int], logits: torch.Tensor) -> list[int]:
        if pick is not None:
            vals, top = pick(logits, [dep[i] for i in nodes])
        else:
            vals, top = topk_rows(logits, min(topk, logits.shape[-1]), log_softmax=True)
        ids = top if vocab is None else vocab[top]
        out = []
        for i, vs, ts in zip(nodes, vals.tolist(), ids.tolist()):
            s, d = score[i], dep[i] + 1
            for val, t in zip(vs, ts):
                out.append(len(tok))
                tok.append(t)
                par.append(i)
                score.append(cal.child_key(s, val))
                dep.append(d)
                cond.append(val)
        return out

    frontier = children([0], first_logits)
    forwards = 1  # draft forwards this step (the commit gave depth 1)
    for _ in range(1, depth):
        expand_ = sorted(frontier, key=lambda i: -score[i])[:topk]
        cut = prune_cut(score, budget)
        if cut is not None:
            expand_ = [i for i in expand_ if score[i] > cut]
            if not expand_:  # no frontier node can place a child in the kept tree: deeper drafts are wasted
                break
        if curve is not None and not worth_expanding(
            [cal.value(x) for x in score[1:]], cal.value(score[expand_[0]]),
            curve, drafting_seconds(forwards), drafting_seconds(forwards + 1) - drafting_seconds(forwards),
        ):  # fmt: skip
            break
        start = base + len(slot_of)
        # each expanded node attends to the committed slots, its expanded ancestors and itself
        mask = torch.zeros((len(expand_), start + len(expand_)), dtype=torch.bool)
        mask[:, :base] = True
        for row, i in enumerate(expand_):
            p = par[i]
            anc[i] = anc[p] + [slot_of[p]] if p > 0 else []
            mask[row, anc[i]] = True
            mask[row, start + row] = True
        logits = yield (
            expand_,
            [tok[i] for i in expand_],
            [par[i] for i in expand_],
            [dep[i] for i in expand_],
            start,
            mask,
        )
        forwards += 1
        for row, i in enumerate(expand_):
            slot_of[i] = start + row
        frontier = children(expand_, logits)
    # rerank: the best nodes by cumulative log-prob; ties keep parents (shallower, earlier) first
    keep = sorted(range(1, len(tok)), key=lambda i: (-score[i], dep[i], i))[:budget]
    if curve is not None:  # a tree that does not beat a plain step (no drafting) backs drafting off
        n, paid = choose_size([cal.value(score[i]) for i in keep], curve, drafting_seconds(forwards))
        keep = keep[:n]
        cal.paid(paid)
    new = {0: 0}
    tokens, parents = [root], [-1]
    for i in keep:
        new[i] = len(tokens)
        tokens.append(tok[i])
        parents.append(new[par[i]])
    probs = [math.exp(cond[i]) for i in keep]  # in tree order: node j + 1 is keep[j]
    return TokenTree(tuple(tokens), tuple(parents)), 1.0 + math.fsum(cal.raw(score[i]) for i in keep), probs


# coupled_pick's scale of the draft's error in log p at temperature 1 (divided by the temperature: the error in the
# logits is tempered with them), calibrated in session 38 (benchmarks/results/session38.md): an EAGLE-class drafter
# (q's top-1 is the target's greedy token ~0.55 of the time) and the target's own int4 copy (~0.98)
COUPLED_SCALE = 1.25
COUPLED_SCALE_CLOSE = 0.08
COUPLED_POOL = 16  # coupled_pick's candidates per row its values are normalised over


def coupled_pick(
    ctx: Any, k: int, vocab: np.ndarray | torch.Tensor | None = None, scale: float = COUPLED_SCALE
) -> Callable[[torch.Tensor, list[int]], tuple[np.ndarray, np.ndarray]] | None:
    """For a sampled request whose tokens are coupled draws (``ctx.coupling``: the target's token at position t is
    the Gumbel-max draw ``argmax_x log p_t(x) + G_t(x)``, :func:`treedraft.sampling.coupled_sample`), the children
    of expanded nodes as :func:`grow_tree`'s ``pick``: the k tokens with the largest ``s(x) = log q(x) + G_t(x)``
    under the draft's own distribution q and the same noise. Where q is near p they are the target's own draw and
    its runners-up (EAGLE depth 1 at T = 1: 0.34 of the target's draws were the perturbed top-1 against 0.26 for
    q's top-1, 0.57 against 0.45 in the top 4; benchmarks/results/session38.md).

    A child's value is not its q (the perturbed top-1 is the target's token far more often than q says: 0.38
    against a mean q of 0.16 for EAGLE at T = 1) but log softmax(s x T / ``scale``) over the row's COUPLED_POOL
    best s: the chance that it is the argmax when the target's tempered log p is the draft's plus a Gumbel error of
    scale ``scale`` / T (EAGLE at T = 1, scale 1: values 0.17 / 0.38 / 0.58 / 0.80 were hit 0.14 / 0.30 / 0.47 /
    0.66 of the time, hence a little more; the int4 copy drafting for its fp32 target at T = 0.7: perturbed top-1
    0.986, and an error scale of 0.1 / T, i.e. ``scale`` 0.07, fit best). Values that promise too much buy verify rows that are not accepted.
    ``vocab``: the token id of each logits column, an array or a tensor (the noise is keyed by the token id). None:
    greedy, or the request is not coupled (grow_tree then takes the top-k)."""
    from ..sampling import gumbel_key, gumbel_topk

    s, seed = getattr(ctx, "sampling", None), getattr(ctx, "coupling", None)
    if seed is None or s is None or s.greedy:
        return None
    first = len(ctx.tokens)  # the position the root's row predicts; a node at depth d's row predicts first + d
    cols = None if vocab is None else torch.as_tensor(vocab, dtype=torch.int64).cpu().contiguous()
    pool = max(k, COUPLED_POOL)

    def pick(logits: torch.Tensor, depths: list[int]) -> tuple[np.ndarray, np.ndarray]:
        rows = logits.float()
        ids, vals = [], []
        for j, d in enumerate(depths):
            c, sc = gumbel_topk(rows[j], s, gumbel_key(seed, first + d), pool, cols)
            z = sc * (s.temperature / scale)
            z = z - z[0]  # the best first
            vals.append(z - np.log(np.exp(z).sum()))
            ids.append(c)
        n = min(k, *(len(c) for c in ids))  # rows keeping fewer than k tokens (top-k / top-p) cut every row to that
        return np.stack([v[:n] for v in vals]), np.stack([c[:n] for c in ids]).astype(np.int64)

    return pick

"""Union of several drafters' trees: one verify pass scores all of their guesses.

Trees are merged as tries (a shared prefix is verified once) under the engine's node budget. The
first tree keeps its node order; later trees' nodes are appended while the budget allows, so the
budget favours the first tree. Which tree is first is decided per step: a member that can say how
many tokens its tree is expected to get accepted (``propose_scored``, e.g. ``suffix``: the sum of its
nodes' empirical path probabilities) *leads* when that is at least ``lead_score``; everyone else
keeps the given order. So a suffix tree following a passage seen before (a long, confident chain)
is not cut to fit behind the Medusa tree, and a weak one only fills what the others left. When a
member leads, the others add at most ``lead_extra`` nodes beyond the leaders' own: a leader's tree is
already sized to what pays for its rows, and another member's diverging 12-token branch next to a
confident 24-token chain costs a third more verify time for little (benchmarks/suffix_trace.py).
With ``lead_extra=0`` the others are not even asked (the Medusa heads' drafting costs ~6 ms a step on a
loaded 2-core CPU, more than half a one-row int4 verify step when quiet).

With ``latency`` (the target's forward seconds by rows, root included), members that can price their
nodes before drafting (``node_values(max_depth)`` and ``draft_cost``: the Medusa heads) are *paid*: after the
scored members proposed, a paid member is asked for its first k nodes only if they raise the step's expected
committed tokens per second (:func:`paid_nodes`), else not run at all. On this project's CPU a third verify
row costs ~1/3 of a step and the heads' drafting ~1/7, while their top guess is accepted ~1/3 of the time,
so the heads draft where the suffix member has nothing to say and stay idle next to its chains
(benchmarks/default_vs_lookup.py).

Only deterministic trees (no ``child_q``) can be merged: a node whose children were
*sampled* would, in the union, also get other drafters' children (and lose its q),
and the lossless rule would then verify it as if chosen deterministically, which
changes the output distribution. Such trees are refused with a :class:`TreeError`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..budget import LatencyCurve
from ..interfaces import DraftContext, Drafter, request_drafter
from ..tree import TokenTree, TreeError
from .steps import Steps, drive, drives_steps, propose_steps


def merge_trees(trees: Sequence[TokenTree], max_nodes: int) -> TokenTree:
    """Merge trees with the same root into one trie of at most ``max_nodes`` nodes."""
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError("cannot merge trees with different roots")
    sampled = [i for i, t in enumerate(trees) if t.child_q]
    if sampled:
        raise TreeError(
            f"cannot merge tree {sampled[0]}: its children were sampled (child_q is set), and merging "
            "would verify them as deterministic drafts, which is not lossless; "
            "use a sampling drafter on its own, or make it propose deterministic (top-k) children"
        )
    grown = [t for t in trees if len(t) > 1]
    if len(grown) == 1 and len(grown[0]) <= max_nodes:
        return grown[0]  # one tree with drafts (a valid trie: no duplicate siblings) merges into itself
    tokens, parents = [root], [-1]
    index: dict[tuple[int, int], int] = {}
    for t in trees:
        where = {0: 0}  # node in t -> node in the merged tree
        for i in range(1, len(t)):
            if t.parents[i] not in where:
                continue
            p = where[t.parents[i]]
            key = (p, t.tokens[i])
            if key not in index:
                if len(tokens) >= max_nodes:
                    continue  # children of a dropped node are dropped too (not in `where`)
                index[key] = len(tokens)
                tokens.append(t.tokens[i])
                parents.append(p)
            where[i] = index[key]
    return TokenTree(tuple(tokens), tuple(parents))


def paid_nodes(
    values: Sequence[float],
    gain: float,
    rows: int,
    miss: float,
    draft_cost: float | Sequence[float],
    curve: LatencyCurve,
    fixed: float = 0.0,
) -> int:
    """How many of a paid member's nodes (its own order, best first) to draft: the k maximising tokens per second.

    The step now verifies ``rows`` rows (root included) for ``gain`` expected committed tokens (1 + the scored
    members' node values). The member's first k nodes add at most k rows and ``miss`` x the sum of their
    values (``miss``: P(no scored node at depth 1 is accepted); where one is, the member's different guess
    is rejected), and its drafting costs ``draft_cost`` seconds once (or ``draft_cost[k - 1]`` for k nodes, a
    member whose drafting grows with its tree: EAGLE's draft forwards per depth). ``fixed``: seconds the step costs
    beyond the curve whatever its rows (a batched step's own overhead). 0 = do not run it (ties: fewer nodes).
    """
    if not values:
        return 0
    if not isinstance(draft_cost, (int, float)) and len(draft_cost) < len(values):
        raise ValueError(f"draft_cost gives {len(draft_cost)} costs for {len(values)} node values")
    lat = curve.table(rows + len(values))
    best, best_rate, w = 0, gain / (lat[rows] + fixed), 0.0
    for k, v in enumerate(values, 1):
        w += v
        cost = draft_cost if isinstance(draft_cost, (int, float)) else draft_cost[k - 1]
        rate = (gain + miss * w) / (lat[rows + k] + fixed + cost)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def _idle(drafter: Drafter, ctx: DraftContext, stub: TokenTree) -> TokenTree:
    """``stub`` for a member not run this step, after telling it (``idle(ctx)``) when it keeps state per step
    (EAGLE's draft KV cache must still take in the committed tokens' features)."""
    idle = getattr(drafter, "idle", None)
    if callable(idle):
        idle(ctx)
    return stub


def fresh_copy(drafter: Drafter | None) -> Drafter | None:
    """``drafter`` with nothing learned from earlier requests (its ``fresh()``); one without such state as is."""
    fresh = getattr(drafter, "fresh", None)
    return fresh() if callable(fresh) else drafter


@dataclass
class HybridDrafter:
    drafters: list[Drafter] = field(default_factory=list)
    name: str = "hybrid"
    lead_score: float = 2.0  # a scored member expecting at least this many accepted tokens goes first
    lead_extra: int | None = 2  # nodes the others may add next to a leading tree (None = up to the budget)
    # forward seconds by rows (root included): paid members draft only the nodes that pay (None = always all)
    latency: Mapping[int, float] | None = None
    _curve: LatencyCurve | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._curve = None if self.latency is None else LatencyCurve(self.latency)

    @drives_steps
    def propose(self, ctx: DraftContext) -> TokenTree:
        """The members' trees merged into one of at most ``ctx.max_nodes`` nodes (confident scored trees first)."""
        return drive(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext) -> Steps:
        """:meth:`propose` as steps (:mod:`.steps`): a member that drafts with a draft model yields its forwards."""
        trees: list[TokenTree | None] = [None] * len(self.drafters)
        lead: list[tuple[float, int]] = []  # (-score, member index) of the members that lead this step
        gain, rows, first = 1.0, 1, 0.0  # the scored trees' expected tokens, rows, P(a depth-1 node accepted)
        for i, d in enumerate(self.drafters):  # scored members first: a leader may make the others unneeded
            valued = getattr(d, "propose_valued", None) if self._curve is not None else None
            scored = getattr(d, "propose_scored", None)
            if callable(valued):
                tree, values = valued(ctx)
                trees[i], score = tree, float(sum(values))
                first += sum(v for v, p in zip(values, tree.parents[1:]) if p == 0)
            elif callable(scored):
                trees[i], score = scored(ctx)
                first += score
            else:
                continue
            gain, rows = gain + score, rows + len(trees[i]) - 1  # type: ignore[arg-type]
            if score >= self.lead_score:
                lead.append((-score, i))
        skip = bool(lead) and self.lead_extra == 0  # the others could add nothing: do not even draft them
        stub = TokenTree((int(ctx.root),), (-1,))
        for i, d in enumerate(self.drafters):
            if trees[i] is not None:
                continue
            priced = getattr(d, "node_values", None) if self._curve is not None and not skip else None
            values = priced(ctx.max_depth) if callable(priced) else None
            if skip:
                trees[i] = _idle(d, ctx, stub)
            elif values is not None and self._curve is not None:
                miss = max(0.0, 1.0 - min(1.0, first))
                values = values[: ctx.max_nodes - 1]
                per_k = getattr(d, "draft_cost_for", None)
                cost = (
                    [per_k(k) for k in range(1, len(values) + 1)] if callable(per_k) else getattr(d, "draft_cost", 0.0)
                )
                # a one-call propose (the heads) priced as decoding timed it, once known (step_costs.py)
                learned = None if callable(per_k) else getattr(self.latency, "learned", None)
                name = getattr(d, "name", type(d).__name__)
                seen = None if learned is None else learned.draft_cost(name)
                cost = cost if seen is None else seen
                # in a batched step the member's rows and its propose delay the whole step (ctx.step_*)
                # priced on the curve at this request's context (a longer cache: dearer rows, budget.ContextLatency)
                curve = self._curve.at(len(ctx.tokens))
                k = paid_nodes(values, gain + ctx.step_tokens, rows + ctx.step_rows, miss, cost, curve, ctx.step_fixed)
                if k == 0:
                    trees[i] = _idle(d, ctx, stub)
                else:
                    t0 = time.perf_counter()
                    trees[i] = yield from propose_steps(d, dataclasses.replace(ctx, max_nodes=k + 1))
                    if learned is not None:
                        learned.observe_draft(name, time.perf_counter() - t0)
            else:
                trees[i] = yield from propose_steps(d, ctx)
        return self._merge([t for t in trees if t is not None], lead, ctx)

    def _merge(self, trees: list[TokenTree], lead: list[tuple[float, int]], ctx: DraftContext) -> TokenTree:
        """Leaders first (at most ``lead_extra`` nodes of the others next to them), then everyone in order."""
        for d, t in zip(self.drafters, trees):
            if isinstance(t, TokenTree) and t.child_q:
                name = getattr(d, "name", type(d).__name__)
                raise TreeError(
                    f"drafter {name!r} sampled its tree's children (child_q is set); the hybrid drafter "
                    "can only merge deterministic trees (merging would verify sampled children as "
                    f"deterministic, which is not lossless): use {name!r} on its own, or in top-k mode"
                )
        first = [i for _, i in sorted(lead)]
        rest = [trees[i] for i in range(len(trees)) if i not in first]
        if not first or self.lead_extra is None:
            return merge_trees([trees[i] for i in first] + rest, ctx.max_nodes)
        led = merge_trees([trees[i] for i in first], ctx.max_nodes)
        return merge_trees([led, *rest], min(ctx.max_nodes, len(led) + self.lead_extra))

    def for_tenant(self, tenant: str) -> HybridDrafter:
        """The same union with every member that keeps per-tenant state (e.g. ``suffix``) bound to ``tenant``."""
        bound = [d.for_tenant(tenant) if callable(getattr(d, "for_tenant", None)) else d for d in self.drafters]
        return dataclasses.replace(self, drafters=bound)

    def fresh(self) -> HybridDrafter:
        """The same union with every member that learns across requests (``fresh()``, e.g. ``suffix``) started over."""
        return dataclasses.replace(self, drafters=[fresh_copy(d) for d in self.drafters])

    def for_request(self) -> HybridDrafter:
        """The same union with every member that keeps per-request state (``for_request``) forked for one request."""
        forked = [request_drafter(d) for d in self.drafters]
        return dataclasses.replace(self, drafters=forked)

    def finish(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Tell every member drafter that keeps per-request state (e.g. ``suffix``) that a request ended."""
        for d in self.drafters:
            fin = getattr(d, "finish", None)
            if callable(fin):
                fin(prompt_ids, output_ids)

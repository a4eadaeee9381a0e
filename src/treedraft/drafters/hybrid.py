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

Only deterministic trees (no ``child_q``) can be merged: a node whose children were
*sampled* would, in the union, also get other drafters' children (and lose its q),
and the lossless rule would then verify it as if chosen deterministically, which
changes the output distribution. Such trees are refused with a :class:`TreeError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..interfaces import DraftContext, Drafter, request_drafter
from ..tree import TokenTree, TreeError


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

    def propose(self, ctx: DraftContext) -> TokenTree:
        """The members' trees merged into one of at most ``ctx.max_nodes`` nodes (confident scored trees first)."""
        trees: list[TokenTree | None] = [None] * len(self.drafters)
        lead: list[tuple[float, int]] = []  # (-score, member index) of the members that lead this step
        for i, d in enumerate(self.drafters):  # scored members first: a leader may make the others unneeded
            scored = getattr(d, "propose_scored", None)
            if callable(scored):
                trees[i], score = scored(ctx)
                if score >= self.lead_score:
                    lead.append((-score, i))
        skip = bool(lead) and self.lead_extra == 0  # the others could add nothing: do not even draft them
        for i, d in enumerate(self.drafters):
            if trees[i] is None:
                trees[i] = TokenTree((int(ctx.root),), (-1,)) if skip else d.propose(ctx)
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

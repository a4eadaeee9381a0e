"""Union of several drafters' trees: one verify pass scores all of their guesses.

Trees are merged as tries (a shared prefix is verified once). The first drafter's
tree keeps its node order; later drafters' nodes are appended while the budget
allows, so the budget favours the first drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine import DraftContext, Drafter
from ..tree import TokenTree


def merge_trees(trees: Sequence[TokenTree], max_nodes: int) -> TokenTree:
    """Merge trees with the same root into one trie of at most ``max_nodes`` nodes."""
    root = trees[0].tokens[0]
    if any(t.tokens[0] != root for t in trees):
        raise ValueError("cannot merge trees with different roots")
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


@dataclass
class HybridDrafter:
    drafters: list[Drafter] = field(default_factory=list)
    name: str = "hybrid"

    def propose(self, ctx: DraftContext) -> TokenTree:
        trees = [d.propose(ctx) for d in self.drafters]
        return merge_trees(trees, ctx.max_nodes)

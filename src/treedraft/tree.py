"""The token tree (draft trie) and pure functions over it.

Node 0 is the root: the token the target already chose (the previous step's
bonus token), not yet in the KV cache. Every other node is a draft token whose
parent index is smaller than its own, so any prefix of the node list is itself
a valid tree (used to shrink a tree to fit the context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


class TreeError(ValueError):
    """A malformed tree (bad parent order, duplicate siblings, bad choices)."""


@dataclass(frozen=True)
class TokenTree:
    """A trie of candidate tokens.

    tokens[i] is node i's token, parents[i] its parent (-1 for the root).
    child_q optionally maps a node to the draft distribution q (V,) its children
    were *sampled* from, in node order and without replacement: child i ~ q with
    children 0..i-1 removed and renormalised (a trie cannot hold the duplicates of
    iid draws, and silently merging them would bias the lossless rule). Nodes absent
    from it had their children chosen deterministically (top-k, lookup), which the
    lossless rule treats as such.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    child_q: dict[int, Tensor] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.parents):
            raise TreeError("a tree needs a root and one parent per token")
        if self.parents[0] != -1:
            raise TreeError("node 0 must be the root (parent -1)")
        seen: set[tuple[int, int]] = set()
        for i in range(1, len(self.tokens)):
            p = self.parents[i]
            if not 0 <= p < i:
                raise TreeError(f"node {i} has parent {p}; parents must precede their children")
            if (p, self.tokens[i]) in seen:
                raise TreeError(f"node {i} duplicates token {self.tokens[i]} under parent {p}")
            seen.add((p, self.tokens[i]))

    def __len__(self) -> int:
        return len(self.tokens)

    # ---- construction -------------------------------------------------
    @staticmethod
    def chain(root: int, seq: Sequence[int] = ()) -> TokenTree:
        return TokenTree.from_sequences(root, [seq])

    @staticmethod
    def from_sequences(root: int, seqs: Sequence[Sequence[int]], max_nodes: int | None = None) -> TokenTree:
        """Insert candidate continuations into a trie (shared prefixes merge), in order."""
        tokens, parents = [int(root)], [-1]
        index: dict[tuple[int, int], int] = {}
        for seq in seqs:
            node = 0
            for t in seq:
                key = (node, int(t))
                if key not in index:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
        return TokenTree(tuple(tokens), tuple(parents))

    @staticmethod
    def from_choices(root: int, choices: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]]) -> TokenTree:
        """Medusa-style tree: choice [a, b] = rank a of depth-1 candidates, then rank b of depth 2.

        candidates[d] lists the ranked candidate tokens for depth d+1. Each choice's
        prefix must itself be a choice (or empty). Choices are placed by (depth, order).
        """
        order = sorted((tuple(c) for c in choices), key=lambda c: (len(c), c))
        node_of: dict[tuple[int, ...], int] = {(): 0}
        tokens, parents = [int(root)], [-1]
        for c in order:
            if not c:
                continue
            if c[:-1] not in node_of:
                raise TreeError(f"choice {list(c)} has no parent choice {list(c[:-1])}")
            d = len(c) - 1
            if d >= len(candidates) or not 0 <= c[-1] < len(candidates[d]):
                raise TreeError(
                    f"choice {list(c)} needs rank {c[-1]} at depth {d + 1}, "
                    f"but only {len(candidates[d]) if d < len(candidates) else 0} candidates exist"
                )
            if c in node_of:
                continue
            node_of[c] = len(tokens)
            tokens.append(int(candidates[d][c[-1]]))
            parents.append(node_of[c[:-1]])
        return TokenTree(tuple(tokens), tuple(parents))

    # ---- derived structure --------------------------------------------
    def depths(self) -> list[int]:
        d = [0] * len(self)
        for i in range(1, len(self)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self) -> list[list[int]]:
        ch: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self)):
            ch[self.parents[i]].append(i)
        return ch

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def truncated(self, n: int) -> TokenTree:
        """The first ``n`` nodes (always a valid tree since parents precede children)."""
        n = max(1, n)
        if n >= len(self):
            return self
        return TokenTree(self.tokens[:n], self.parents[:n], {k: v for k, v in self.child_q.items() if k < n})

    def pruned_depth(self, max_depth: int) -> TokenTree:
        """Drop nodes deeper than ``max_depth``."""
        d = self.depths()
        keep = [i for i in range(len(self)) if d[i] <= max_depth]
        return self if len(keep) == len(self) else self.kept(keep)

    def kept(self, keep: Sequence[int], drop_q: set[int] | frozenset[int] = frozenset()) -> TokenTree:
        """The tree of nodes ``keep`` (ascending, the root first, each one's parent kept too), renumbered; the
        nodes in ``drop_q`` lose their ``child_q``."""
        remap = {old: new for new, old in enumerate(keep)}
        return TokenTree(
            tuple(self.tokens[i] for i in keep),
            tuple(-1 if i == 0 else remap[self.parents[i]] for i in keep),
            {remap[k]: v for k, v in self.child_q.items() if k in remap and k not in drop_q},
        )


def matched_depth(tree: TokenTree, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` the tree holds as a path below its root (what greedy acceptance would take).

    Works on any object with ``tokens`` and ``parents`` (benchmarks compare against older TokenTree copies).
    """
    kids: dict[int, dict[int, int]] = {}
    for i, p in enumerate(tree.parents):
        if p >= 0:
            kids.setdefault(p, {})[tree.tokens[i]] = i
    node = d = 0
    for t in tokens:
        nxt = kids.get(node, {}).get(t)
        if nxt is None:
            break
        node, d = nxt, d + 1
    return d


def _ancestor_bits(parents: Sequence[int]) -> np.ndarray:
    """(N, N) bool array: row i has True at i and at every ancestor of i (parents precede children).

    Each row is built as a Python int bit set (row of the parent | own bit) and unpacked in one NumPy
    call: O(N) Python steps instead of N tensor ops.
    """
    n = len(parents)
    anc = [0] * n
    for i, p in enumerate(parents):
        anc[i] = (anc[p] if p >= 0 else 0) | (1 << i)
    nb = (n + 7) // 8
    raw = np.frombuffer(b"".join(a.to_bytes(nb, "little") for a in anc), dtype=np.uint8).reshape(n, nb)
    return np.unpackbits(raw, axis=1, count=n, bitorder="little").view(np.bool_)


def tree_mask(tree: TokenTree) -> Tensor:
    """(N, N) bool: node i may attend to node j iff j is i itself or an ancestor."""
    return torch.from_numpy(_ancestor_bits(tree.parents))


def tree_positions(tree: TokenTree, start: int, device: torch.device | str | None = None) -> Tensor:
    """(N,) rotary positions: ``start + depth``, on ``device`` (default cpu)."""
    return torch.tensor([start + d for d in tree.depths()], dtype=torch.long, device=device)


def full_attention_mask(tree: TokenTree, start: int, device: torch.device | str | None = None) -> Tensor:
    """(N, start + N) bool: all of the committed prefix plus the tree mask, on ``device`` (default cpu)."""
    n = len(tree)
    m = np.ones((n, start + n), dtype=np.bool_)  # built on the CPU, then copied over once
    m[:, start:] = _ancestor_bits(tree.parents)
    out = torch.from_numpy(m)
    return out if device is None else out.to(device)


def retrieve_indices(tree: TokenTree) -> Tensor:
    """(num_leaves, max_depth + 1) node indices of every root-to-leaf path, -1 padded."""
    ch = tree.children()
    leaves = [i for i in range(len(tree)) if not ch[i]]
    paths = [tree.path_to(leaf) for leaf in leaves]
    width = max(len(p) for p in paths)
    out = torch.full((len(paths), width), -1, dtype=torch.long)
    for r, p in enumerate(paths):
        out[r, : len(p)] = torch.tensor(p)
    return out

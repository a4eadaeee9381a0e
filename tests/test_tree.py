"""Property tests of the token tree and its pure functions (mask, positions, retrieve indices)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.tree import TokenTree, TreeError, full_attention_mask, retrieve_indices, tree_mask, tree_positions

V = 12


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 24) -> TokenTree:
    """Random valid trees: parent of node i drawn from [0, i), sibling tokens made distinct."""
    n = draw(st.integers(1, max_nodes))
    tokens, parents = [draw(st.integers(0, V - 1))], [-1]
    used: dict[int, set[int]] = {}
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        sib = used.setdefault(p, set())
        if len(sib) == V:  # parent full: hang the node under node i-1, which has no children yet
            p = i - 1
            sib = used.setdefault(p, set())
        t = draw(st.integers(0, V - 1))
        while t in sib:
            t = (t + 1) % V
        sib.add(t)
        tokens.append(t)
        parents.append(p)
    return TokenTree(tuple(tokens), tuple(parents))


def ancestors_or_self(tree: TokenTree, i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = tree.parents[i]
    return out


def depth(tree: TokenTree, i: int) -> int:
    return len(ancestors_or_self(tree, i)) - 1


def token_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    """Every node as the tuple of draft tokens from the root (exclusive) down to it."""
    return {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in range(len(tree))}


def follow(tree: TokenTree, seq: list[int]) -> int | None:
    """Node reached by walking ``seq`` from the root, or None."""
    kids = tree.children()
    node = 0
    for t in seq:
        node = next((c for c in kids[node] if tree.tokens[c] == t), None)
        if node is None:
            return None
    return node


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 50))
def test_mask_and_positions(tree: TokenTree, start: int) -> None:
    m = tree_mask(tree)
    n = len(tree)
    assert m.shape == (n, n) and m.dtype == torch.bool
    for i in range(n):
        anc = ancestors_or_self(tree, i)
        assert [bool(m[i, j]) for j in range(n)] == [j in anc for j in range(n)]
    pos = tree_positions(tree, start)
    assert pos.tolist() == [start + depth(tree, i) for i in range(n)]
    full = full_attention_mask(tree, start)
    assert full.shape == (n, start + n)
    assert bool(full[:, :start].all()) and torch.equal(full[:, start:], m)


@settings(max_examples=150, deadline=None)
@given(trees())
def test_retrieve_indices_are_root_to_leaf_paths(tree: TokenTree) -> None:
    ri = retrieve_indices(tree)
    kids = tree.children()
    leaves = [i for i in range(len(tree)) if not kids[i]]
    assert ri.shape == (len(leaves), max(depth(tree, i) for i in range(len(tree))) + 1)
    ends = []
    for row in ri.tolist():
        k = row.index(-1) if -1 in row else len(row)
        path, pad = row[:k], row[k:]
        assert all(x == -1 for x in pad)
        assert path[0] == 0
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert not kids[path[-1]]
        ends.append(path[-1])
    assert sorted(ends) == leaves  # every leaf exactly once


seqs_strategy = st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=8)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, V - 1), seqs_strategy)
def test_from_sequences_merges_prefixes(root: int, seqs: list[list[int]]) -> None:
    tree = TokenTree.from_sequences(root, seqs)
    assert tree.tokens[0] == root
    for s in seqs:
        node = follow(tree, s)
        assert node is not None and [tree.tokens[j] for j in tree.path_to(node)[1:]] == s
    prefixes = {tuple(s[:k]) for s in seqs for k in range(len(s) + 1)} | {()}
    assert token_paths(tree) == prefixes  # merged: one node per distinct prefix, nothing else
    assert len(tree) == len(prefixes)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, V - 1), seqs_strategy, st.integers(1, 20))
def test_from_sequences_max_nodes_is_a_prefix(root: int, seqs: list[list[int]], cap: int) -> None:
    full = TokenTree.from_sequences(root, seqs)
    capped = TokenTree.from_sequences(root, seqs, max_nodes=cap)
    assert len(capped) == min(cap, len(full))
    assert capped == full.truncated(cap)


def test_from_choices_medusa_example() -> None:
    choices = [[0], [0, 0], [1], [0, 1], [0, 0, 0]]
    cands = [[10, 11, 12], [20, 21], [30]]
    tree = TokenTree.from_choices(7, choices, cands)
    # placed by (depth, choice): (0,) (1,) (0,0) (0,1) (0,0,0)
    assert tree.tokens == (7, 10, 11, 20, 21, 30)
    assert tree.parents == (-1, 0, 0, 1, 1, 3)
    assert token_paths(tree) == {(), (10,), (11,), (10, 20), (10, 21), (10, 20, 30)}
    # duplicates and the empty choice are harmless
    assert TokenTree.from_choices(7, choices + [[0], []], cands) == tree


@pytest.mark.parametrize(
    "choices, cands",
    [
        ([[0, 1]], [[1, 2], [3, 4]]),  # no parent choice [0]
        ([[0], [1, 0, 0]], [[1, 2], [3], [4]]),  # [1, 0] missing
        ([[2]], [[1, 2]]),  # rank out of range
        ([[-1]], [[1, 2]]),  # negative rank
        ([[0], [0, 0]], [[1]]),  # no candidates for depth 2
    ],
)
def test_from_choices_rejects_bad_choices(choices: list[list[int]], cands: list[list[int]]) -> None:
    with pytest.raises(TreeError):
        TokenTree.from_choices(0, choices, cands)


def _with_q(tree: TokenTree) -> TokenTree:
    kids = tree.children()
    q = {i: torch.full((V,), float(i)) for i in range(len(tree)) if kids[i]}
    return TokenTree(tree.tokens, tree.parents, q)


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 30))
def test_truncated_is_valid_prefix(tree: TokenTree, n: int) -> None:
    tree = _with_q(tree)
    t = tree.truncated(n)
    k = max(1, min(n, len(tree)))
    assert len(t) == k
    assert t.tokens == tree.tokens[:k] and t.parents == tree.parents[:k]
    assert set(t.child_q) == {i for i in tree.child_q if i < k}
    TokenTree(t.tokens, t.parents)  # re-validates


@settings(max_examples=150, deadline=None)
@given(trees(), st.integers(0, 6))
def test_pruned_depth_keeps_shallow_subtree(tree: TokenTree, d: int) -> None:
    tree = _with_q(tree)
    t = tree.pruned_depth(d)
    TokenTree(t.tokens, t.parents)
    assert max(t.depths()) <= d
    assert token_paths(t) == {p for p in token_paths(tree) if len(p) <= d}
    for new, q in t.child_q.items():  # each q still belongs to the same node (same token path)
        path = tuple(t.tokens[j] for j in t.path_to(new)[1:])
        old = follow(tree, list(path))
        assert old is not None and torch.equal(tree.child_q[old], q)


@pytest.mark.parametrize(
    "tokens, parents",
    [
        ((), ()),
        ((1, 2), (-1,)),
        ((1, 2), (0, 0)),  # node 0 is not a root
        ((1, 2, 3), (-1, 0, 2)),  # parent does not precede the child
        ((1, 2, 3), (-1, 0, 5)),
        ((1, 2), (-1, -1)),  # second root
        ((1, 2, 2), (-1, 0, 0)),  # duplicate siblings
    ],
)
def test_malformed_trees_raise(tokens: tuple[int, ...], parents: tuple[int, ...]) -> None:
    with pytest.raises(TreeError):
        TokenTree(tokens, parents)


def test_same_token_under_different_parents_is_fine() -> None:
    t = TokenTree((1, 2, 2, 2), (-1, 0, 1, 2))
    assert t.depths() == [0, 1, 2, 3]
    assert retrieve_indices(t).tolist() == [[0, 1, 2, 3]]


def test_matched_depth_follows_the_tokens_down_one_path() -> None:
    from treedraft.tree import matched_depth

    # root 0 -> 5 -> {6 -> 8, 7}; root 0 -> 9
    t = TokenTree((0, 5, 9, 6, 7, 8), (-1, 0, 0, 1, 1, 3))
    assert matched_depth(t, [5, 6, 8, 1]) == 3  # the deepest path, then a token the tree lacks
    assert matched_depth(t, [5, 7, 8]) == 2  # 8 sits below 6, not below 7
    assert matched_depth(t, [9]) == 1
    assert matched_depth(t, [5, 1, 6]) == 1  # the walk stops at the first miss: 6 after it does not count
    assert matched_depth(t, [6]) == 0  # 6 is not a child of the root
    assert matched_depth(t, []) == 0

"""The suffix index's fast paths (block matching, plain-Python small cases, chain runs) against the
one-token-at-a-time reference: the same match, the same trees node for node."""

from __future__ import annotations

import heapq

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.drafters.suffix_index import SEP, DraftPaths, SuffixIndex
from treedraft.drafters.suffix_sizing import ACCEPT_PRIOR, AcceptanceModel, calibrated_values, node_depths


def reference_match(
    idx: SuffixIndex, context: list[int], max_len: int, min_len: int, max_occurrences: int | None
) -> tuple[int, np.ndarray]:
    """SuffixIndex.match as first written: seed, then narrow one token further back per round."""
    if not context or max_len < 1 or min_len > min(max_len, len(context)):
        return 0, np.empty(0, dtype=np.int64)
    text, n = idx.text, len(idx)
    w = min(max(1, min_len), len(context))
    j = min(range(w), key=lambda i: len(idx.positions(context[-1 - i])))
    nxt = idx.positions(context[-1 - j]).astype(np.int64) + (j + 1)
    if max_occurrences is not None and nxt.size > max_occurrences:
        nxt = nxt[-max_occurrences:]
    nxt = nxt[(nxt - w >= 0) & (nxt < n)]
    for i in range(w):
        if i != j and nxt.size:
            nxt = nxt[text[nxt - 1 - i] == context[-1 - i]]
    if nxt.size:
        nxt = nxt[text[nxt] != SEP]
    if nxt.size == 0:
        return 0, nxt
    m = w
    while m < min(max_len, len(context)):
        back = nxt - 1 - m
        ok = back >= 0
        ok[ok] = text[back[ok]] == context[-1 - m]
        if not ok.any():
            break
        nxt = nxt[ok]
        m += 1
    return m, nxt


def reference_expand(
    idx: SuffixIndex, nxt: np.ndarray, m: int, max_nodes: int, max_depth: int, min_prob: float, max_occ: int
) -> DraftPaths:
    """SuffixIndex.expand as first written: one heap entry per child, numpy grouping for every node."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    if max_nodes < 1 or max_depth < 1 or nxt.size == 0:
        return DraftPaths(tokens, parents, probs, m)
    text, n = idx.text, len(idx)
    heap: list = []
    tick = 0

    def push(pos: np.ndarray, parent: int, depth: int, prob: float) -> None:
        nonlocal tick
        if depth >= max_depth:
            return
        pos = pos[-max_occ:]
        pos = pos[pos < n]
        if pos.size == 0:
            return
        nt = text[pos]
        total = pos.size
        live = nt != SEP
        pos, nt = pos[live], nt[live]
        for t in sorted(set(nt.tolist())):
            grp = pos[nt == t]
            p = prob * grp.size / total
            if p >= min_prob:
                tick += 1
                heapq.heappush(heap, (-p, tick, parent, depth + 1, grp + 1))

    push(nxt, -1, 0, 1.0)
    while heap and len(tokens) < max_nodes:
        negp, _, parent, depth, pos = heapq.heappop(heap)
        tokens.append(int(text[pos[0] - 1]))
        parents.append(parent)
        probs.append(-negp)
        push(pos, len(tokens) - 1, depth, -negp)
    return DraftPaths(tokens, parents, probs, m)


@st.composite
def repetitive_text(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Sequences over a small alphabet with copied passages (long matches, chains, many occurrences), and a
    context that ends in one of them, or in fresh tokens."""
    alphabet = draw(st.integers(2, 6))
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 5))):
        s: list[int] = []
        for _ in range(draw(st.integers(0, 6))):
            if s and draw(st.booleans()):  # copy an earlier passage of this or another sequence
                src = draw(st.sampled_from([x for x in [*seqs, s] if x]))
                a = draw(st.integers(0, len(src) - 1))
                s += src[a : a + draw(st.integers(1, 80))]
            else:
                s += draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=40))
        seqs.append(s)
    src = draw(st.sampled_from(seqs))
    cut = draw(st.integers(0, len(src)))
    ctx = src[max(0, cut - draw(st.integers(0, 90))) : cut] + draw(st.lists(st.integers(0, alphabet), max_size=3))
    return seqs, ctx or [0]


@settings(max_examples=300, deadline=None)
@given(
    data=repetitive_text(),
    max_len=st.integers(1, 70),
    min_len=st.integers(1, 3),
    max_occ=st.sampled_from([None, 1, 3, 20, 4096]),
    bulk=st.booleans(),
)
def test_match_equals_the_one_token_at_a_time_reference(data, max_len, min_len, max_occ, bulk) -> None:
    seqs, ctx = data
    idx = SuffixIndex.from_sequences(seqs) if bulk else SuffixIndex()
    if not bulk:
        for s in seqs:
            for i in range(0, len(s), 7):
                idx.extend(s[i : i + 7])
            idx.extend([], end=True)
    m, nxt = idx.match(ctx, max_len, min_len, max_occ)
    m_ref, nxt_ref = reference_match(idx, ctx, max_len, min_len, max_occ)
    assert m == m_ref
    assert nxt.dtype == np.int64 and nxt.tolist() == nxt_ref.tolist()


@settings(max_examples=300, deadline=None)
@given(
    data=repetitive_text(),
    max_nodes=st.integers(1, 64),
    max_depth=st.integers(1, 64),
    min_prob=st.sampled_from([0.0, 0.1, 0.3]),
    max_occ=st.sampled_from([1, 2, 40, 256]),
    open_end=st.booleans(),
)
def test_expand_equals_the_reference_node_for_node(data, max_nodes, max_depth, min_prob, max_occ, open_end) -> None:
    seqs, ctx = data
    idx = SuffixIndex.from_sequences(seqs[:-1]) if open_end else SuffixIndex.from_sequences(seqs)
    if open_end:  # the request's own index: the last sequence still open (chains may run into its end)
        idx.extend(seqs[-1])
    m, nxt = idx.match(ctx, 64, 1)
    got = idx.expand(nxt, m, max_nodes, max_depth, min_prob, max_occ)
    want = reference_expand(idx, nxt, m, max_nodes, max_depth, min_prob, max_occ)
    assert (got.tokens, got.parents, got.probs) == (want.tokens, want.parents, want.probs)


def test_a_single_occurrence_chain_is_followed_to_the_depth_cap_and_stops_at_a_separator() -> None:
    passage = list(range(100, 140))
    idx = SuffixIndex.from_sequences([passage, [1, 2]])
    m, nxt = idx.match(passage[:5], 64, 1)
    assert (m, nxt.tolist()) == (5, [5])
    chain = idx.expand(nxt, m, 64, 64)
    assert chain.tokens == passage[5:] and chain.parents == list(range(-1, 34)) and chain.probs == [1.0] * 35
    assert idx.expand(nxt, m, 64, 10).tokens == passage[5:15]
    assert idx.expand(nxt, m, 7, 64).tokens == passage[5:12]


def test_calibrated_values_use_the_prior_table_like_the_bucket_scan() -> None:
    model = AcceptanceModel()
    for e in range(0, 130):  # the table against the definition: the value of the highest bucket at or below e
        assert model.prior_prob(e) == next((q for low, q in reversed(ACCEPT_PRIOR) if e >= low), ACCEPT_PRIOR[0][1])
    model.observe(3, False)
    model.observe(20, True)
    assert model.probs(5, 70) == [model.prob(e) for e in range(5, 75)]
    paths = DraftPaths([7, 8, 9, 4], [-1, 0, 1, 0], [0.75, 0.5, 0.5, 0.25], 6)
    depth = node_depths(paths.parents)
    want: list[float] = []
    for i, p in enumerate(paths.parents):
        ratio = paths.probs[i] / (paths.probs[p] if p >= 0 else 1.0)
        want.append((want[p] if p >= 0 else 1.0) * model.prob(6 + depth[i] - 1) * ratio)
    assert calibrated_values(paths, model) == want


def test_a_chain_of_several_occurrences_keeps_the_rounding_of_count_ratios() -> None:
    # 9 of 10 occurrences of token 1 go on with 2 3 4 5: the branch's probability 0.9, times 9 / 9 per step,
    # is not exactly 0.9 in floating point; the chain shortcut must compute it the same way
    idx = SuffixIndex.from_sequences([[1, 2, 3, 4, 5]] * 9 + [[1, 6]])
    m, nxt = idx.match([7, 1], 64, 1)
    got = idx.expand(nxt, m, 64, 64, min_prob=0.2)  # the 0.1 branch is dropped: the chain is alone in the heap
    want = reference_expand(idx, nxt, m, 64, 64, 0.2, 1024)
    assert got.tokens == [2, 3, 4, 5] and got.probs == want.probs and got.probs[1] != 0.9


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 5)), min_size=0, max_size=30),
    budget=st.integers(1, 40),
)
def test_merging_one_grown_tree_is_the_general_merge(shape: list[tuple[int, int]], budget: int) -> None:
    from treedraft.drafters.hybrid import merge_trees
    from treedraft.tree import TokenTree

    seqs: list[list[int]] = []
    for at, tok in shape:  # sequences sharing prefixes: a trie with branches
        base = seqs[at % len(seqs)] if seqs else []
        seqs.append(base[: at % (len(base) + 1)] + [tok])
    tree = TokenTree.from_sequences(9, seqs)
    root_only = TokenTree((9,), (-1,))
    general = merge_trees([tree, tree], budget)  # two grown trees: the general trie merge
    for trees in ([tree], [tree, root_only], [root_only, tree, root_only]):
        got = merge_trees(trees, budget)
        assert (got.tokens, got.parents) == (general.tokens, general.parents)

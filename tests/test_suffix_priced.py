"""Priced suffix expansion (best-first by calibrated value, stopped where a row stops paying) and following
the last step's match: the same answers as the full expansion + best_prefix and as a fresh match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_suffix_fast import repetitive_text

from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_index import SuffixIndex
from treedraft.drafters.suffix_sizing import AcceptanceModel, LatencyCurve, RatePricer, best_prefix, calibrated_values
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext

CURVES = [
    {1: 1.0, 64: 1.001},  # rows nearly free: every node pays
    {1: 1.0, 2: 2.0, 64: 64.0},  # every row costs a step: nothing pays
    {1: 8.5, 2: 8.7, 4: 10.8, 8: 17.8, 12: 23.9, 16: 30.4, 24: 46.2, 32: 64.3, 48: 93.5, 64: 127.4},  # int4 Xeon
    {1: 1.0, 4: 1.1, 5: 2.5, 64: 70.0},  # flat, then a sharp knee
]


def paths_of(tokens: list[int], parents: list[int], values: list[float]) -> dict[tuple[int, ...], float]:
    """{path of tokens from the root: value} of a tree (order-free, for comparing trees built differently)."""
    path: list[tuple[int, ...]] = []
    for t, p in zip(tokens, parents):
        path.append((*(path[p] if p >= 0 else ()), t))
    return dict(zip(path, values))


@settings(max_examples=300, deadline=None)
@given(
    data=repetitive_text(),
    curve=st.sampled_from(CURVES),
    size=st.integers(1, 64),
    failed=st.integers(0, 6),
    min_prob=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_priced_expansion_keeps_exactly_the_best_prefix_of_the_full_calibrated_tree(
    data, curve, size, failed, min_prob
) -> None:
    seqs, ctx = data
    idx = SuffixIndex.from_sequences(seqs)
    m, nxt = idx.match(ctx, 64, 1)
    model = AcceptanceModel()
    for _ in range(failed):  # a request whose drafts were cut short: lower h at every match length
        model.observe(m + 1, False)
    accept = model.probs(m, 64)
    lat = LatencyCurve(curve)
    # everything the index holds above min_prob, best-first by calibrated value, no pricing
    full = idx.expand(nxt, m, 4096, 64, min_prob, 256, accept)
    keep, gain = best_prefix(full.probs, lat, max_nodes=size)
    pricer = RatePricer(lat, max_nodes=size)
    priced = idx.expand(nxt, m, size, 64, min_prob, 256, accept, pricer.take)
    n = pricer.best
    assert keep == list(range(len(keep)))  # the full tree comes out best-first: its best prefix is a prefix
    assert (priced.tokens[:n], priced.parents[:n]) == (full.tokens[: len(keep)], full.parents[: len(keep)])
    assert abs(pricer.gain - gain) < 1e-9


@settings(max_examples=200, deadline=None)
@given(data=repetitive_text(), min_prob=st.sampled_from([0.0, 0.1]))
def test_calibrated_expansion_values_each_node_as_calibrated_values_does(data, min_prob) -> None:
    seqs, ctx = data
    idx = SuffixIndex.from_sequences(seqs)
    m, nxt = idx.match(ctx, 64, 1)
    model = AcceptanceModel()
    model.observe(m, False)
    emp = idx.expand(nxt, m, 4096, 24, min_prob, 256)  # the whole tree (empirical order and probabilities)
    cal = idx.expand(nxt, m, 4096, 24, min_prob, 256, model.probs(m, 24))
    want = paths_of(emp.tokens, emp.parents, calibrated_values(emp, model))
    got = paths_of(cal.tokens, cal.parents, cal.probs)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-9 for k in want)
    assert all(a >= b for a, b in zip(cal.probs, cal.probs[1:]))  # best-first


@settings(max_examples=300, deadline=None)
@given(
    data=repetitive_text(),
    split=st.integers(1, 12),
    local=st.booleans(),
    max_len=st.sampled_from([1, 2, 3, 5, 8, 10**6]),
)
def test_following_the_last_match_equals_a_fresh_match(data, split, local, max_len) -> None:
    seqs, ctx = data
    head, new = ctx[: max(1, len(ctx) - split)], ctx[max(1, len(ctx) - split) :]
    if local:  # the request's own index: it holds the context and grows with it
        idx = SuffixIndex()
        idx.extend(head)
    else:  # an index of earlier requests, unchanged between the steps
        idx = SuffixIndex.from_sequences(seqs)
    m, nxt = idx.match(head, max_len, 1)
    if local:
        idx.extend(new)
    got = idx.follow(new, m, nxt, max_len)
    m2, nxt2 = idx.match(head + new, max_len, 1)
    if got is None:  # no occurrence went on (a fresh match is shorter), or it would pass the cap
        assert not new or m == 0 or m2 < m + len(new) or m + len(new) > max_len
    else:  # below the cap: exactly the fresh match (at the cap a fresh match counts more occurrences)
        assert got[0] == m2 and got[1].tolist() == nxt2.tolist()


def test_follow_hands_a_match_reaching_max_len_back_to_a_fresh_match() -> None:
    idx = SuffixIndex.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8]])
    m, nxt = idx.match([1, 2, 3], 5, 1)
    assert (m, nxt.tolist()) == (3, [3])
    got = idx.follow([4, 5], m, nxt, 5)
    assert got is not None and got[0] == 5 and got[1].tolist() == [5]
    assert idx.follow([9], m, nxt, 5) is None  # the occurrence goes on with 4, not 9
    assert idx.follow([4, 5, 6], m, nxt, 5) is None  # 6 tokens > max_len: a capped match needs a fresh lookup
    # why: capped at 2 tokens, [9, 3, 4] matches every "3 4" (two occurrences); following [1, 2, 3] + [4]
    # would keep only the one after "1 2 3"
    idx2 = SuffixIndex.from_sequences([[1, 2, 3, 4, 5], [7, 3, 4, 6]])
    m, nxt = idx2.match([1, 2, 3], 2, 1)
    assert idx2.follow([4], m, nxt, 2) is None
    assert len(idx2.match([1, 2, 3, 4], 2, 1)[1]) == 2


@settings(max_examples=60, deadline=None)
@given(data=repetitive_text(), seed=st.integers(0, 3), max_match=st.sampled_from([2, 4, 10**6]))
def test_a_drafter_following_its_matches_drafts_the_trees_of_one_that_rematches(data, seed, max_match) -> None:
    seqs, _ = data
    text = seqs[seed % len(seqs)]  # a request that copies an earlier one (the store holds them all)
    drafters = []
    for follow in (True, False):
        store = SuffixStore()
        for s in seqs:
            if s:
                store.add(s)
        drafters.append(SuffixDrafter(store, min_match=1, max_match=max_match, follow=follow))
    toks = [text[0]] if text else [0]
    i = 1
    while i < len(text):
        ctx = [DraftContext(toks, None, 16, 8, 1) for _ in drafters]
        a, b = (d.propose(c) for d, c in zip(drafters, ctx))
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        step = 1 + (i % 3)  # commit 1-3 tokens, as accepted drafts + the bonus token would
        toks.extend(text[i : i + step])
        i += step

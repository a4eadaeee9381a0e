"""Suffix tree sizing by verify cost: calibrated node values, the latency curve, per-request adaptation."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_index import DraftPaths
from treedraft.drafters.suffix_sizing import (
    AcceptanceModel,
    LatencyCurve,
    best_prefix,
    calibrated_values,
    periodic_extend,
)
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree

FLAT = {1: 1.0, 64: 1.001}  # rows nearly free (a big accelerator): every likely node pays
STEEP = {1: 1.0, 2: 2.0, 64: 64.0}  # every row costs a whole step: no draft pays
CPU = {1: 10.8, 2: 11.9, 4: 19.1, 8: 29.3, 16: 51.8, 32: 90.9, 64: 208.3}  # int4 SmolLM2 on a Xeon, ms


def passage(n: int, seed: int = 0) -> list[int]:
    """n distinct token ids in random order (no accidental repeats)."""
    ids = list(range(100, 100 + n))
    random.Random(seed).shuffle(ids)
    return ids


def sized(latency: dict[int, float], **kw) -> SuffixDrafter:
    """A request-local suffix drafter sized by ``latency``, long chains allowed."""
    return SuffixDrafter(None, latency=latency, alpha=4.0, max_spec_tokens=64, max_depth=64, **kw)


def chain(tree: TokenTree) -> list[int]:
    """The tokens of a single-path tree below the root (asserts it is one)."""
    assert list(tree.parents) == [-1, *range(len(tree) - 1)], tree.parents
    return list(tree.tokens[1:])


def test_a_long_match_on_a_cheap_verifier_drafts_the_whole_passage_up_to_the_budget() -> None:
    p = passage(60)
    toks = p + p[:30]  # a 30-token match; the passage continues 30 more tokens, then (periodically) repeats
    tree = sized(FLAT).propose(DraftContext(list(toks), None, 64, 64, 0))
    assert chain(tree) == (p + p)[30:93]
    tree = sized(FLAT).propose(DraftContext(list(toks), None, 12, 64, 0))  # the node budget caps it
    assert chain(tree) == p[30:41]


def test_the_same_match_drafts_nothing_where_every_row_costs_a_step() -> None:
    p = passage(60)
    assert len(sized(STEEP).propose(DraftContext(p + p[:30], None, 64, 64, 0))) == 1


def test_on_the_cpu_curve_longer_matches_earn_longer_chains() -> None:
    p = passage(200)
    lens = [len(sized(CPU).propose(DraftContext(p + p[:m], None, 64, 64, 0))) - 1 for m in (2, 8, 40)]
    assert lens[0] < lens[1] < lens[2] <= 63, lens
    assert 0 < lens[0] <= 3, lens  # a 2-token match: a node or two, not SuffixDecoding's alpha x m = 8


def test_a_rejected_expectation_shrinks_the_next_chains() -> None:
    p = passage(300)
    parts, b = [p[i * 50 : (i + 1) * 50] for i in range(4)], p[200:]
    toks = list(p)  # four passages and then b, each seen once
    d = sized(CPU)
    for i, a in enumerate(parts):  # each passage starts again; the drafter follows it, the target leaves it at once
        toks += ([] if i == 0 else [5000 + i]) + a[:20]  # the same list: the next propose scores the last tree
        assert d.propose(DraftContext(toks, None, 64, 64, 0)).tokens[1] == a[20]
    toks += [6000, *b[:12]]  # now b repeats: a 12-token match with one occurrence
    after = d.propose_scored(DraftContext(toks, None, 64, 64, 0))
    assert d.acceptance.kappa > 1.3
    fresh = sized(CPU).propose_scored(DraftContext(list(toks), None, 64, 64, 0))  # same context, no history
    assert chain(after[0]) == b[12 : 12 + len(after[0]) - 1] and chain(fresh[0])[0] == b[12]
    assert after[1] < fresh[1] and len(after[0]) < len(fresh[0]), (len(after[0]), len(fresh[0]))


def test_accepted_chains_grow_the_next_ones() -> None:
    p = passage(120)
    toks = p + p[:10]
    d = sized(CPU)
    first = d.propose(DraftContext(toks, None, 64, 64, 0))
    toks += chain(first) + [p[10 + len(chain(first))]]  # all accepted, plus the bonus token
    assert d.acceptance.kappa == 1.0
    d.propose(DraftContext(toks, None, 64, 64, 0))
    assert d.acceptance.kappa < 1.0
    m = len(toks) - 120
    fresh = sized(CPU).propose_scored(DraftContext(list(toks), None, 64, 64, 0))
    assert d.propose_scored(DraftContext(toks, None, 64, 64, 0))[1] > fresh[1], m


def test_a_loop_is_drafted_past_the_end_of_the_context() -> None:
    toks = [5, 6, 7, 8] + [1, 2, 3] * 6
    tree = sized(FLAT).propose(DraftContext(toks, None, 20, 64, 0))
    assert chain(tree) == ([1, 2, 3] * 7)[:19]  # the index alone stops after 3 tokens (the end of the text)
    assert len(sized(FLAT, periodic=False).propose(DraftContext(list(toks), None, 20, 64, 0))) == 4


def test_periodic_extend_only_follows_an_occurrence_the_tree_holds() -> None:
    ctx = [9, 1, 2, 1, 2]
    paths = DraftPaths([1, 2], [-1, 0], [1.0, 1.0], 2)
    ext = periodic_extend(paths, ctx, 3, 6)  # occurrence right after ctx[1:3]: continues 1, 2, 1, 2, ...
    assert ext.tokens == [1, 2, 1, 2, 1, 2] and ext.parents == [-1, 0, 1, 2, 3, 4]
    other = DraftPaths([5], [-1], [1.0], 2)
    assert periodic_extend(other, ctx, 3, 6) is other


def test_values_are_path_probabilities_times_calibrated_acceptance() -> None:
    model = AcceptanceModel(((1, 0.5), (4, 0.9)))
    paths = DraftPaths([7, 8, 9], [-1, 0, 0], [1.0, 0.75, 0.25], 3)  # e = 3 at depth 1, 4 at depth 2
    assert calibrated_values(paths, model) == pytest.approx([0.5, 0.5 * 0.9 * 0.75, 0.5 * 0.9 * 0.25])
    model.observe(4, False)  # one failure where the prior expected 0.1: every failure rate scales up
    assert model.prob(4) < 0.9 and model.prob(1) < 0.5
    with pytest.raises(ValueError, match="start at 1"):
        AcceptanceModel(((2, 0.5),))


def test_latency_curve_ignores_a_slow_outlier_and_never_decreases() -> None:
    c = LatencyCurve({1: 10.0, 8: 30.0, 16: 90.0, 32: 100.0, 64: 200.0})  # 16 rows measured under load
    assert float(c(16)) == pytest.approx(30.0 + (100.0 - 30.0) * 8 / 24)
    assert np.all(np.diff(c(np.arange(1, 80))) >= 0) and float(c(80)) > 200.0
    with pytest.raises(ValueError, match="one-row"):
        LatencyCurve({2: 1.0})


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(0.0, 1.0), min_size=0, max_size=20), flat=st.booleans())
def test_best_prefix_maximises_expected_tokens_per_second(values: list[float], flat: bool) -> None:
    curve = LatencyCurve(FLAT if flat else CPU)
    vals = sorted(values, reverse=True)  # a chain: values never increase along it
    keep, score = best_prefix(vals, curve)
    assert keep == list(range(len(keep)))
    rate = [(1 + sum(vals[:n])) / float(curve(n + 1)) for n in range(len(vals) + 1)]
    assert (1 + score) / float(curve(len(keep) + 1)) == pytest.approx(max(rate))


def test_a_leading_chain_keeps_other_members_to_lead_extra_nodes() -> None:
    store = SuffixStore()
    store.add(list(range(100, 140)))
    # earlier in this request "117 118 119" went on with 50..61: prompt lookup's branch diverges from the store's
    ctx = DraftContext([117, 118, 119, *range(50, 62), 5, *range(100, 120)], None, 64, 24, 1)
    members = [PromptLookupDrafter(max_tokens=12), SuffixDrafter(store, use_local=False)]
    lead = members[1].propose(ctx)
    follow = members[0].propose(ctx)
    assert len(lead) > 4 and follow.tokens[1] == 50 and len(follow) > 3
    assert len(HybridDrafter(members, lead_extra=2).propose(ctx)) == len(lead) + 2
    assert len(HybridDrafter(members, lead_extra=None).propose(ctx)) > len(lead) + 2


class MustNotDraft:
    """A member that fails the test if it is asked for a tree."""

    name = "must-not-draft"

    def propose(self, ctx: DraftContext) -> TokenTree:
        raise AssertionError("drafted although a confident member leads and lead_extra == 0")


def test_with_lead_extra_zero_a_leader_spares_the_others_their_drafting() -> None:
    store = SuffixStore()
    store.add(list(range(100, 140)))
    lead_ctx = DraftContext([5, *range(100, 120)], None, 64, 24, 1)  # a 20-token match in the store
    h = HybridDrafter([MustNotDraft(), SuffixDrafter(store, use_local=False)], lead_extra=0)
    assert h.propose(lead_ctx).tokens[1:4] == (120, 121, 122)
    with pytest.raises(AssertionError, match="drafted although"):  # no leader: everyone drafts
        h.propose(DraftContext([5, 6, 7], None, 64, 24, 1))

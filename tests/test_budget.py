"""The batch's row budget (treedraft.budget): draft nodes go where their expected acceptance pays for the rows."""

from __future__ import annotations

import random

import pytest

from treedraft.budget import NodeStats, RowBudget, interpolate

# a CPU-like curve (seconds): a few rows are nearly free, then every row costs ~2.8 ms (quiet Skylake, int4)
CPU = {1: 0.0108, 2: 0.0119, 4: 0.0191, 8: 0.0293, 16: 0.0518, 32: 0.0966, 64: 0.186}


def _history(p_hit: float, steps: int = 40, size: int = 9, seed: int = 0) -> NodeStats:
    """Stats of a request whose chain drafts were each accepted (after an accepted parent) with probability p_hit."""
    rng = random.Random(seed)
    st = NodeStats()
    for _ in range(steps):
        n = 0
        while n < size - 1 and rng.random() < p_hit:
            n += 1
        st.observe(size, list(range(n + 1)), 0.85)
    st.idle = 0  # it has been drafting
    return st


def test_interpolate() -> None:
    assert interpolate(CPU, 8) == CPU[8]
    assert interpolate(CPU, 12) == pytest.approx((CPU[8] + CPU[16]) / 2)
    assert interpolate(CPU, 128) == pytest.approx(CPU[64] + (CPU[64] - CPU[32]) * 2)  # linear beyond the last


def test_a_lone_cheap_step_takes_drafts_a_full_batch_only_sure_ones() -> None:
    good, weak = _history(0.97), _history(0.5)
    # rows nearly free up to 16 (a GPU-like curve): even weak drafts get rows
    assert all(s > 1 for s in RowBudget({1: 0.010, 16: 0.011, 64: 0.04}).allocate([good, weak], [9, 9]))
    b = RowBudget(CPU)
    # two requests on the CPU curve: the sure drafts fill the cheap rows, the coin flips do not pay
    two = b.allocate([good, weak], [9, 9])
    assert two[0] > 2 and two[1] == 1
    # eight requests (8 root rows, ~2.8 ms per extra row): only the request whose drafts are nearly always
    # accepted gets nodes; the others decode plainly
    sizes = b.allocate([good] + [weak] * 7, [9] * 8)
    assert sizes[0] > 2 and sizes[1:] == [1] * 7


def test_no_drafts_when_rows_cost_more_than_they_give() -> None:
    linear = {1: 0.01, 2: 0.02, 64: 0.64}  # every row costs a full step: a draft must be certain to pay
    b = RowBudget(linear)
    assert b.allocate([_history(0.9), _history(0.9)], [9, 9]) == [1, 1]


def test_caps_and_fixed_rows_are_respected() -> None:
    b = RowBudget(CPU)
    good = _history(1.0)
    assert b.allocate([good, good], [3, 1]) == [3, 1]
    # a step already full of prefill rows leaves no room for drafts at the margin cost
    few = b.allocate([good, good], [9, 9], fixed_rows=0)
    many = b.allocate([good, good], [9, 9], fixed_rows=200)
    assert sum(many) <= sum(few)


def test_new_and_idle_requests_are_probed() -> None:
    b = RowBudget(CPU, probe_every=3)
    assert b.allocate([NodeStats()] + [_history(0.2) for _ in range(7)], [9] * 8)[0] == 4  # a new request
    weak = _history(0.1)
    strong = [_history(0.2) for _ in range(7)]
    for _ in range(3):
        assert b.allocate([weak, *strong], [9] * 8)[0] == 1
        b.observe(weak, 1, [0], 0.0)
    assert b.allocate([weak, *strong], [9] * 8)[0] == 4  # idle for probe_every steps: a probe of 3 nodes
    assert b.allocate([weak, *strong], [2] + [9] * 7)[0] == 2  # within its cap
    b.observe(weak, 2, [0, 1], 0.0)
    assert weak.idle == 0


def test_estimates_follow_the_request_not_only_the_pool() -> None:
    b = RowBudget(CPU)
    for _ in range(30):  # the pool has seen mediocre drafts
        b.observe(NodeStats(), 5, [0, 1], 0.001)
    good, bad = _history(1.0), _history(0.0)
    eg, eb = b.estimates(good, 4), b.estimates(bad, 4)
    assert eg[0] > 0.9 and (not eb or eb[0] < 0.3)  # shrunk toward the pool, far below it
    assert all(x >= y for x, y in zip(eg, eg[1:]))  # non-increasing
    with pytest.raises(ValueError, match="one-row"):
        RowBudget({2: 0.1})


def _expected_rate(b: RowBudget, stats: list[NodeStats], sizes: list[int]) -> float:
    """Expected tokens per second of a step with these tree sizes (the budget's own model)."""
    tokens = sum(1 + sum(b.estimates(st, s - 1)[: s - 1]) for st, s in zip(stats, sizes))
    return tokens / (b.seconds(sum(sizes)) + sum(s > 1 for s in sizes) * b.draft_cost)


def test_a_propose_cost_concentrates_sure_chains_on_few_requests() -> None:
    """Eight requests whose drafts are all accepted (repeated text), each propose costing 2.3 ms: ordering nodes by
    probability alone interleaves the requests (every one pays a propose for one node) and drafts nothing; the
    chain groups let one or two requests draft long chains, which the curve pays for."""
    curve = {1: 0.0085, 2: 0.0087, 4: 0.0108, 8: 0.0178, 12: 0.0239, 16: 0.0304, 24: 0.0462, 32: 0.0643}
    b = RowBudget(curve)
    b.draft_cost = 0.0023
    stats = []
    for i in range(
        8
    ):  # all nearly sure; a little less deeper and for later requests, so by probability they interleave
        st = NodeStats()
        st.tries = [100.0] * len(st.tries)
        st.hits = [100.0 - 0.5 * j - 0.15 * i for j in range(len(st.hits))]
        st.idle = 0
        stats.append(st)
    sizes = b.allocate(stats, [12] * 8)
    assert sum(s > 1 for s in sizes) in (1, 2) and sum(sizes) >= 16, sizes
    assert _expected_rate(b, stats, sizes) > _expected_rate(b, stats, [1] * 8) * 1.05
    for k in range(1, 9):  # better than every request drafting the same short chain
        assert _expected_rate(b, stats, sizes) > _expected_rate(b, stats, [1 + k] * 8)
    b.draft_cost = 0.0  # free proposes: most probable nodes first, as before
    assert b.allocate([_history(0.97), _history(0.5)], [9, 9])[1] == 1


def test_drafting_is_priced_by_how_many_requests_draft_as_measured() -> None:
    """Requests drafting with one draft model share its packed forwards (drafters.steps): a step's drafting costs
    about the same for one request as for four. Priced as four times one request's (the old linear rule), the fp32
    batch let two of four requests draft; priced as measured per count, all four draft their sure chains."""
    b = RowBudget({1: 0.0143, 2: 0.0149, 4: 0.0155, 8: 0.0235, 12: 0.0298, 16: 0.0378, 24: 0.0528})  # fp32, Zen 4
    assert b.drafting_seconds(3) == 0.0  # nothing measured, no propose cost: free
    b.draft_cost = 0.005
    assert b.drafting_seconds(3) == pytest.approx(0.015) and b.drafting_seconds(0) == 0.0
    b.observe_drafting(2, 0.010)
    assert b.drafting_seconds(4) == pytest.approx(0.020) and b.drafting_seconds(1) == pytest.approx(0.005)
    for _ in range(50):
        b.observe_drafting(1, 0.018)
        b.observe_drafting(4, 0.020)
    assert b.drafting_seconds(2) == pytest.approx(0.010)  # measured at that count
    assert b.drafting_seconds(3) == pytest.approx(0.015, rel=1e-3)  # between 2 and 4
    assert b.drafting_seconds(4) == pytest.approx(0.020, rel=1e-6)
    assert b.drafting_seconds(6) > 0.020  # beyond: along the last two counts' line
    b.drafting = {1: 0.018, 2: 0.0185, 3: 0.019, 4: 0.0195}
    sure = []
    for _ in range(4):
        st = NodeStats()
        st.tries = [100.0] * len(st.tries)
        st.hits = [99.0] * 4 + [10.0] * (len(st.hits) - 4)  # three sure draft nodes, then misses
        st.idle = 0
        sure.append(st)
    assert b.allocate(sure, [4] * 4) == [4, 4, 4, 4]
    b.drafting = {d: 0.018 * d for d in range(1, 5)}  # drafters that do not pack: each request pays its own
    assert sum(s > 1 for s in b.allocate(sure, [4] * 4)) < 4


def test_a_step_overhead_beyond_the_curve_makes_drafts_pay() -> None:
    """Time every step costs whatever its rows (a batch's own attention, acceptance, streaming) raises the value of
    a drafted token: a coin-flip draft that does not pay on the bare curve does once the steps are seen to take
    longer than the curve says; a step period far off the curve (the worker waited) is not taken as evidence."""
    b = RowBudget(CPU)
    weak = [_history(0.6, seed=i) for i in range(8)]
    assert b.allocate(weak, [9] * 8) == [1] * 8
    b.observe_step(8, 100 * CPU[8])  # a pause, not a step's cost: ignored
    assert b.overhead == 0.0
    for _ in range(20):
        b.observe_step(8, CPU[8] + 0.03)  # every step takes 30 ms more than its forward
    assert b.overhead == pytest.approx(0.03, rel=1e-6)
    assert sum(b.allocate(weak, [9] * 8)) > 8
    b.observe_step(8, CPU[8] * 0.5)  # faster than the curve: no negative overhead
    assert 0.0 < b.overhead < 0.03


def test_a_request_whose_probes_miss_is_probed_ever_more_rarely() -> None:
    """Each draft step with nothing accepted doubles the wait for the next probe (up to 2^PROBE_BACKOFF x
    probe_every); an accepted node resets it, so a request that starts repeating known text is still found."""
    from treedraft.budget import PROBE_BACKOFF

    b = RowBudget(CPU, probe_every=3)
    weak, strong = _history(0.1), [_history(0.2) for _ in range(7)]

    def steps_to_probe() -> int:
        n = 0
        while b.allocate([weak, *strong], [9] * 8)[0] == 1:
            b.observe(weak, 1, [0], 0.0)
            n += 1
        return n

    waits = []
    for _ in range(PROBE_BACKOFF + 2):
        waits.append(steps_to_probe())
        b.observe(weak, 4, [0], 0.0)  # the probe: nothing accepted
    assert waits[0] <= 3 and waits[1:] == [3 * 2**k for k in range(1, PROBE_BACKOFF)] + [3 * 2**PROBE_BACKOFF] * 2
    b.observe(weak, 4, [0, 1], 0.0)  # a probe that hits
    assert weak.misses == 0 and steps_to_probe() == 3


def test_one_slow_drafting_step_does_not_price_a_count_out_for_thousands_of_steps() -> None:
    """The step a request first drafts in can hold its draft model's prompt catch-up (150 ms): taken outright, that
    count was priced out, chosen again only by probes, and so re-measured only every ~64 steps (a review: ~2,000
    steps of one request not drafting). One observation now moves a count's price at most to twice what it was."""
    b = RowBudget({1: 0.0143, 2: 0.0149, 4: 0.0155, 8: 0.0235, 12: 0.0298, 16: 0.0378, 24: 0.0528})
    sure = []
    for _ in range(2):
        st = NodeStats()
        st.tries = [100.0] * len(st.tries)
        st.hits = [99.0] * 4 + [10.0] * (len(st.hits) - 4)
        st.idle = 0
        sure.append(st)
    for _ in range(30):
        b.observe_drafting(1, 0.005)
        b.observe_drafting(2, 0.0055)  # packed: two cost about what one does
    assert b.allocate(sure, [4, 4]) == [4, 4]
    b.observe_drafting(2, 0.155)  # a step at two drafting requests with a prompt catch-up in it
    assert b.drafting_seconds(2) <= 0.0061
    assert b.allocate(sure, [4, 4]) == [4, 4]
    said = b.drafting_seconds(3)  # a count not measured before: along the measured ones' line
    b.observe_drafting(3, 0.155)  # ... and after a slow first step there, at most twice that
    assert said < 0.008 and b.drafting_seconds(3) <= 2 * said + 1e-12


def test_a_first_drafting_observation_is_bounded_by_the_one_row_forward() -> None:
    """With nothing measured yet, a step that held a draft model's prompt catch-up (155 ms) was taken as the price of
    drafting, and nobody drafted again until probes re-measured it: now at most 4 one-row forwards."""
    b = RowBudget({1: 0.0143, 2: 0.0149, 4: 0.0155, 8: 0.0235, 12: 0.0298, 16: 0.0378, 24: 0.0528})
    b.observe_drafting(2, 0.155)
    assert b.drafting_seconds(2) <= 4 * 0.0143 + 1e-12
    st = NodeStats()
    b.observe(st, 4, [0, 1, 2, 3], 0.155)
    assert b.draft_cost <= 4 * 0.0143 + 1e-12


def _sure(forwards: bool) -> NodeStats:
    """A request whose first 3 draft nodes were nearly always on the accepted path and the next ones 70% of the time,
    every node drafted with a draft-model forward (a draft model's chain: ``forwards``) or none (e.g. a suffix chain)."""
    st = NodeStats()
    st.tries = [100.0] * len(st.tries)
    st.hits = [99.0] * 4 + [70.0] * (len(st.hits) - 4)
    st.rounds = [100.0 * forwards] * len(st.tries)
    st.idle = 0
    return st


def test_draft_model_forwards_are_priced_per_round_of_depth_shared_by_the_batch() -> None:
    """A draft model drafts one packed forward per depth for all requests drafting with it (drafters.steps). Priced
    per count of drafting requests only, a chain of 12 cost the budget what a chain of 1 did, and the learned price
    (measured on whatever depths ran) put off short chains that paid (session 40: four fp32 requests, two of them
    decoding plainly next to two sure chains). Now a step's rounds are learned apart from the rest of drafting and a
    chain is priced by its depth: sure chains of a draft model stop where a further round costs more than it gives,
    the same chains without draft-model forwards (a suffix chain) run to the cap, and requests sharing the rounds
    draft to the same depth."""
    b = RowBudget({1: 0.0143, 2: 0.0149, 4: 0.0155, 8: 0.0235, 12: 0.0298, 16: 0.0378, 24: 0.0528})  # fp32, Zen 4
    for _ in range(30):
        b.observe_drafting(2, 0.012, rounds=2, round_seconds=0.010)
    assert b.round_cost == pytest.approx(0.005) and b.drafting_seconds(2) == pytest.approx(0.002)
    # a 70% node pays for its row (~1.9 ms) but not also for half a 5 ms round
    assert b.allocate([_sure(False), _sure(False)], [13, 13]) == [13, 13]
    assert b.allocate([_sure(True), _sure(True)], [13, 13]) == [4, 4]
    # a request whose draft model ran in a third of its steps, three deep (a suffix chain led the others): its long
    # chain is priced at about one expected round, not at one round per node (12 rounds of 10 ms would not pay)
    mixed = _sure(False)
    mixed.rounds = [0.0] + [33.0] * 3 + [0.0] * (len(mixed.rounds) - 4)
    b.round_cost = 0.010
    assert b.allocate([mixed, mixed], [13, 13]) == [13, 13]
    assert b.allocate([], [], fixed_rows=3, fixed_tokens=3) == []  # a step of pinned or plain requests only
    b.round_cost = 0.0  # (without rounds measured: the count's price alone, as before)
    assert b.allocate([_sure(True), _sure(True)], [13, 13]) == [13, 13]


def test_draft_model_requests_are_also_tried_at_one_common_depth_valued_by_the_pool() -> None:
    """Four requests drafting with one draft model (its rounds priced), two of them after one missed first draft
    (own estimate a third of the pool's): node by node the budget let only the two sure ones draft, or none, where
    equal shares (every request a 3-node chain, each drafter sizing its own) ran ~228 tok/s against ~200 (session
    40). Every request to one depth, valued by the pool's estimates, is now tried too, and taken here."""
    b = RowBudget({1: 0.0143, 2: 0.0149, 4: 0.0155, 8: 0.0235, 12: 0.0298, 16: 0.0378, 24: 0.0528})  # fp32, Zen 4
    for _ in range(30):
        b.observe_drafting(4, 0.020, rounds=3, round_seconds=0.015)
    for _ in range(40):  # the pool: chains of 3 drafted with a forward each, nearly always accepted
        b.observe(NodeStats(), 4, [0, 1, 2, 3], 0.005, forwards=3)
    sure = [_sure(True), _sure(True)]
    missed = []
    for _ in range(2):
        st = NodeStats()
        b.observe(st, 4, [0], 0.005, pool=False, forwards=3)  # its first draft: nothing accepted
        st.idle = 0
        missed.append(st)
    sizes = b.allocate(sure + missed, [4] * 4)
    assert sizes == [4, 4, 4, 4]

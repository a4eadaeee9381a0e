"""Step costs learned in decoding (step_costs.py): the measured curve's shape corrected by the steps' own timings."""

from __future__ import annotations

import math

import pytest
from oracle_drafter import Oracle

from treedraft import step_costs
from treedraft.budget import ContextLatency, LatencyCurve, MeasuredLatency
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.tiny import tiny_llama
from treedraft.step_costs import EXPLORE_BURST, EXPLORE_EVERY, EXPLORE_WARM, MIN_WEIGHT, StepCosts, step_costs_of
from treedraft.tree import TokenTree


@pytest.fixture(autouse=True)
def _learning_on(monkeypatch) -> None:
    monkeypatch.setenv("TREEDRAFT_LEARN_COSTS", "1")  # (the suite's conftest turns it off elsewhere)
    monkeypatch.setenv("TREEDRAFT_RATE_GUARD", "0")  # its pauses would add one-row steps (tests/test_rate_guard.py)


PRIOR = {1: 10.0, 2: 10.5, 4: 12.0, 8: 16.0}  # measured cold: extra rows look cheap (convex: the hull keeps it)
TRUE = {1: 5.0, 2: 5.75, 4: 7.5, 8: 12.0}  # what decoding meets: relative to one row, 1.15x / 1.5x / 2.4x


def _learned(prior=PRIOR, truth=TRUE, reps: int = 20) -> tuple[MeasuredLatency, StepCosts]:
    lat = MeasuredLatency(prior)
    lat.learned = costs = StepCosts(lat)
    for _ in range(reps):
        for n, t in truth.items():
            if n == 1:  # one-row steps are the anchor after a one-row step only
                costs.observe(1, 100, t)
            costs.observe(n, 100, t)
    return lat, costs


def test_the_learned_curve_keeps_the_one_row_time_and_takes_decodings_shape() -> None:
    lat, costs = _learned()
    assert costs.shape() == pytest.approx([1.0, 1.15 / 1.05, 1.5 / 1.2, 2.4 / 1.6])
    curve = LatencyCurve(lat).at(100)
    # decoding's relative costs on the measured one-row time: 10, 11.5, 15, 24 (3 rows between 2 and 4)
    assert [float(curve(n)) for n in (1, 2, 3, 4, 8)] == pytest.approx([10.0, 11.5, 13.25, 15.0, 24.0])
    # the plain curve and a disabled learner: as measured
    assert float(LatencyCurve(PRIOR).at(100)(4)) == 12.0
    costs.set_enabled(False)
    assert float(LatencyCurve(lat).at(100)(4)) == pytest.approx(12.0)
    costs.set_enabled(True)
    assert float(LatencyCurve(lat).at(100)(4)) == pytest.approx(15.0)


def test_a_concave_learned_shape_is_smoothed_to_a_convex_curve() -> None:
    """The sizers stop adding rows where one more stops paying: right only on a convex curve. Decoding's shape with a
    dear second row (1.4x one row, then +0.2x a row) is smoothed like a measurement: its lower hull."""
    lat, _ = _learned(truth={1: 5.0, 2: 7.0, 4: 9.0, 8: 12.0})
    curve = LatencyCurve(lat).at(0)
    # points 10, 14, 18, 24 (on the measured one-row time): 2 and 4 rows lie above the 1 -> 8 chord
    assert [float(curve(n)) for n in (1, 2, 4, 8)] == pytest.approx([10.0, 12.0, 16.0, 24.0])


def test_a_point_the_hull_drops_stays_dropped_and_a_reused_curve_follows_new_versions() -> None:
    noisy = {1: 10.0, 2: 10.5, 4: 12.0, 8: 30.0, 12: 22.0, 16: 26.0}  # 8 rows measured under load: above the hull
    hulled = LatencyCurve(noisy)  # (drops 8 rows, and 12 a little: 21.3 on the 4 -> 16 segment)
    lat, costs = _learned(prior=noisy, truth={n: float(hulled(n)) for n in noisy if n != 8})
    assert costs.shape() == pytest.approx([1.0] * 6)  # decoding met the (hulled) curve everywhere
    curve = LatencyCurve(lat)
    assert float(curve.at(0)(8)) == pytest.approx(float(hulled(8))) and float(hulled(8)) < 20  # not 30
    assert float(curve.at(0)(4)) == pytest.approx(12.0)
    for _ in range(16):  # decoding's 16-row steps turn dearer: the same curve object follows the next version
        costs.observe(16, 0, 2 * 26.0)
    assert float(curve.at(0)(16)) > 30.0 and float(curve.at(0)(1)) == pytest.approx(10.0)  # (26 measured)


def test_no_correction_until_the_one_row_cost_and_another_size_are_known() -> None:
    lat, costs = _learned(truth={2: 5.75, 4: 7.5})  # a drafter that always drafts: no one-row step seen
    assert costs.shape() is None and costs.version == 0
    assert float(LatencyCurve(lat).at(0)(4)) == 12.0
    for _ in range(int(MIN_WEIGHT) + 1):  # (the first, right after a 4-row step, is not the anchor)
        costs.observe(1, 100, 5.0)
    for _ in range(8):  # the next version comes with the next batch of observations
        costs.observe(4, 100, 7.5)
    assert costs.version >= 1
    # a size never observed takes its nearest known neighbours' correction (beyond the largest: held): 8 rows x 1.25
    assert costs.adjust(PRIOR) == pytest.approx({1: 10.0, 2: 11.5, 4: 15.0, 8: 20.0})
    expected = LatencyCurve({1: 10.0, 2: 11.5, 4: 15.0, 8: 20.0})  # (its hull: 4 rows lie above the 2 -> 8 chord)
    assert [float(LatencyCurve(lat).at(0)(n)) for n in (2, 4, 8)] == pytest.approx(
        [float(expected(n)) for n in (2, 4, 8)]
    )


def test_a_size_between_measured_ones_is_shared_by_distance() -> None:
    costs = StepCosts(PRIOR)
    costs.observe(3, 0, 11.25 * 2)  # 3 rows: prior 11.25 (between 2 and 4), took twice that
    assert costs.weight.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert costs.log_ratio[1] == pytest.approx(math.log(2)) and costs.log_ratio[2] == pytest.approx(math.log(2))
    costs.observe(64, 0, 16.0 * 8)  # beyond the largest size: the largest one's
    assert costs.weight[3] == 1.0


def test_a_paused_step_moves_a_known_ratio_only_so_far() -> None:
    _, costs = _learned()
    costs.observe(1, 100, 5.0)
    before = costs.log_ratio[0]
    costs.observe(1, 100, 5.0 * 1000)  # preempted for a long time
    assert costs.log_ratio[0] - before <= step_costs.ALPHA * step_costs.MAX_STEP + 1e-12
    # and nonsense is ignored
    w = costs.weight.copy()
    costs.observe(0, 100, 1.0)
    costs.observe(2, 100, 0.0)
    assert (costs.weight == w).all()


def test_observations_are_relative_to_the_curve_at_their_context() -> None:
    long = {1: 20.0, 2: 24.0, 4: 30.0, 8: 48.0}
    lat = ContextLatency(PRIOR, 256, long, 1024)
    costs = StepCosts(lat)
    for _ in range(10):
        costs.observe(1, 1024, 20.0)
        costs.observe(1, 1024, 20.0)  # exactly the curve at 1,024 tokens (after a one-row step: the anchor)
        costs.observe(4, 1024, 30.0)
    assert costs.shape() == pytest.approx([1.0, 1.0, 1.0, 1.0])
    for _ in range(40):
        costs.observe(4, 256, 24.0)  # twice the short curve's 4 rows (12)
    assert costs.shape()[2] > 1.5


def test_one_row_steps_are_asked_for_in_bursts_until_known_then_seldom() -> None:
    costs = StepCosts(PRIOR)
    due = []
    for _ in range(3 * EXPLORE_WARM):
        due.append(costs.explore_due())
        costs.observe(1 if due[-1] else 4, 0, 12.0 if not due[-1] else 10.0)
    # a burst of EXPLORE_BURST one-row steps every EXPLORE_WARM steps (counted from the last anchor step)
    first = due.index(True)
    assert first == EXPLORE_WARM - 1 and due[first : first + EXPLORE_BURST] == [True] * EXPLORE_BURST
    assert not due[first + EXPLORE_BURST]
    assert costs.weight[0] == pytest.approx(due.count(True) - due.count(True) // EXPLORE_BURST)  # burst heads: not
    for _ in range(int(MIN_WEIGHT)):
        costs.observe(1, 0, 10.0)
    gaps = 0
    while not costs.explore_due():
        costs.observe(4, 0, 12.0)
        gaps += 1
    assert gaps == EXPLORE_EVERY - 1
    got = [True]  # (the loop's last call opened a burst)
    for _ in range(EXPLORE_BURST):
        costs.observe(1, 0, 10.0)  # the burst's one-row steps
        got.append(costs.explore_due())
    assert got == [True] * EXPLORE_BURST + [False]


def test_a_one_row_step_after_a_tree_is_not_the_anchor() -> None:
    """On session 43's Xeon a one-row step right after tree steps cost 4.0-4.5 ms where plain decoding's took 3.4:
    the cost of not drafting is what a run of one-row steps pays, so only a one-row step after one is the anchor."""
    costs = StepCosts(PRIOR)
    for _ in range(10):
        costs.observe(4, 0, 12.0)
        costs.observe(1, 0, 20.0)  # after a tree: dear, and ignored
    assert costs.weight[0] == 0
    costs.observe(1, 0, 5.0)  # after a one-row step (the last one above): the anchor
    assert costs.weight[0] == 1 and costs.log_ratio[0] == pytest.approx(math.log(0.5))
    # a forward the learner does not observe (a backoff pause, a batched step) still tells what the next comes after
    costs.saw(8)
    costs.observe(1, 0, 5.0)
    assert costs.weight[0] == 1
    costs.saw(1)
    costs.observe(1, 0, 5.0)
    assert costs.weight[0] == 2
    # the rule before session 43 (benchmarks A/B it): every one-row step, exploration one step at a time
    old = StepCosts(PRIOR)
    old.sustained_anchor = False
    old.observe(4, 0, 12.0)
    old.observe(1, 0, 20.0)
    assert old.weight[0] == 1 and old.log_ratio[0] == pytest.approx(math.log(2.0))
    for _ in range(EXPLORE_WARM - 1):
        assert not old.explore_due()
        old.observe(4, 0, 12.0)
    assert old.explore_due()
    old.observe(1, 0, 20.0)
    assert not old.explore_due()

    costs.set_enabled(False)
    assert not costs.explore_due()


def test_the_heads_drafting_is_priced_as_decoding_timed_it_on_the_curves_scale() -> None:
    _, costs = _learned()  # decoding's one-row forward: half the curve's
    assert costs.draft_cost("heads") is None
    costs.observe_draft("heads", 500.0)  # a slow first propose (the first call after load) among normal ones
    for _ in range(int(MIN_WEIGHT) - 1):
        costs.observe_draft("heads", 1.5)
    assert costs.draft_cost("heads") == pytest.approx(3.0)  # 1.5 s next to a 5 s forward = 3 s next to 10 s
    costs.observe_draft("heads", 1000.0)  # one preempted propose: at most twice the mean
    assert costs.draft_cost("heads") <= 3.0 * 2
    # priced out (never timed again): once every DRAFT_RETIME asks it gets the measured price, to be timed again
    asks = [costs.draft_cost("heads") for _ in range(2 * step_costs.DRAFT_RETIME)]
    assert asks.count(None) == 2 and asks[step_costs.DRAFT_RETIME - 2] is None


class Paid:
    name = "heads"

    def __init__(self) -> None:
        self.draft_cost, self.asked = 0.1, 0

    def node_values(self, max_depth: int) -> list[float]:
        return [0.5]

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.asked += 1
        return TokenTree((ctx.root, 100), (-1, 0))


def test_the_hybrid_stops_running_heads_that_decoding_found_dear() -> None:
    lat, costs = _learned(truth={1: 10.0, 2: 11.0, 4: 12.0, 8: 16.0})  # the curve is right
    paid = Paid()
    h = HybridDrafter([paid], latency=lat)
    ctx = DraftContext([1, 2, 3], None, max_nodes=8, max_depth=4)
    for _ in range(int(MIN_WEIGHT)):  # cheap enough: 1.5 tokens / (11 + 0.1) > 1 / 10; its proposes are timed
        assert h.propose(ctx).tokens == (3, 100)
    assert paid.asked == int(MIN_WEIGHT) and costs.draft_cost("heads") is not None
    for _ in range(300):  # decoding says a propose costs two forwards (a jump from microseconds: followed gradually)
        costs.observe_draft("heads", 20.0)
    assert costs.draft_cost("heads") == pytest.approx(20.0, rel=0.01)
    assert h.propose(ctx).tokens == (3,) and paid.asked == int(MIN_WEIGHT)


def test_decoding_teaches_the_models_learner_and_takes_one_row_steps_greedy_unchanged() -> None:
    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = step_costs.step_costs_for(m, lat)
    assert step_costs_of(m) is lat.learned and step_costs.step_costs_for(m, MeasuredLatency(lat)) is lat.learned
    prompt, cfg = [1, 5, 9, 5, 9, 5, 9, 3, 5], GenerationConfig(max_new_tokens=80)
    plain = Engine(m).generate(prompt, cfg, None).token_ids
    assert lat.learned.weight.sum() == 0  # plain decoding is not observed
    out = Engine(m).generate(prompt, cfg, Oracle(lat, prompt, plain))
    assert out.token_ids == plain
    steps = out.stats.steps
    one_row = [i for i, s in enumerate(steps[:-1]) if s.tree_size == 1]
    heads = [i for i in one_row if steps[i - 1].tree_size > 1]  # a burst's first step: after a tree
    # every verify step observed but the last (no room for a draft: its drafter was not asked) and the bursts' heads
    assert lat.learned.weight.sum() == pytest.approx(len(steps) - 1 - len(heads))
    # the drafter always drafts: the one-row steps are the ones the scheduler asked for, in bursts of EXPLORE_BURST,
    # the first EXPLORE_WARM steps in
    assert heads[0] == EXPLORE_WARM - 1 and len(heads) >= 2
    for h in heads:
        burst = [i for i in one_row if h <= i < h + EXPLORE_BURST]
        assert burst == list(range(h, min(h + EXPLORE_BURST, len(steps) - 1)))
    assert len(one_row) == sum(min(EXPLORE_BURST, len(steps) - 1 - h) for h in heads)
    # two requests in one forward: not observed (another regime), no exploration
    from treedraft.scheduler import Scheduler

    seen = lat.learned.weight.sum()
    sched = Scheduler(Engine(m), step_rows=16)
    reqs = [sched.add(prompt, cfg, Oracle(lat, prompt, plain)), sched.add(prompt, cfg, Oracle(lat, prompt, plain))]
    while not all(r.done for r in reqs):
        sched.step()
    assert lat.learned.weight.sum() == seen and all(s.tree_size > 1 for r in reqs for s in r.stats.steps[:-1])
    # off: nothing learned, no one-row steps asked for
    lat.learned.set_enabled(False)
    again = Engine(m).generate(prompt, cfg, Oracle(lat, prompt, plain))
    assert again.token_ids == plain
    assert lat.learned.weight.sum() == seen and all(s.tree_size > 1 for s in again.stats.steps[:-1])


def test_measured_latency_carries_the_learner_unless_turned_off(monkeypatch, tmp_path) -> None:
    from treedraft import budget

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    monkeypatch.setattr(
        "treedraft.training.calibrate.measure_latency",
        lambda model, ctx, sizes, reps=5: {n: 1e-3 * (1 + n / 8) for n in sizes},
    )
    m = tiny_llama()
    lat = budget.measured_latency(m)
    assert isinstance(lat.learned, StepCosts) and step_costs_of(m) is lat.learned
    assert budget.measured_latency(m).learned is lat.learned  # one learner per model and curve
    monkeypatch.setenv("TREEDRAFT_LEARN_COSTS", "0")
    m2 = tiny_llama()
    assert getattr(budget.measured_latency(m2), "learned", None) is None and step_costs_of(m2) is None


def test_the_default_drafter_learning_on_the_real_model_keeps_greedy_output(smollm_int4) -> None:
    """The shipped default (``hybrid-suffix``: heads paid, suffix sized on the curve) with learning on, on the bundled
    model: the learner is fed and corrects the curve, one-row steps are taken, and the text is plain decoding's."""
    from treedraft.drafters import registry

    llm = smollm_int4
    d = registry.build("hybrid-suffix", llm.model, llm.tokenizer, llm.drafters.options)
    costs = d.latency.learned
    assert isinstance(costs, StepCosts) and step_costs_of(llm.model) is costs
    prompt = llm.encode_prompt([{"role": "user", "content": "Write three sentences about the sea."}])
    cfg = GenerationConfig(max_new_tokens=96)
    plain = llm.engine.generate(prompt, cfg, None).token_ids
    seen = costs.weight.sum()
    try:
        out = llm.engine.generate(prompt, cfg, d)
        assert out.token_ids == plain
        steps = out.stats.steps
        # every step observed, but one-row ones its drafter was not asked for (a backoff pause, the last step)
        assert len(steps) - sum(s.tree_size == 1 for s in steps) <= costs.weight.sum() - seen <= len(steps)
        assert costs.weight[0] >= 2  # the one-row steps the scheduler asked for (8 steps apart while warming up)
    finally:  # the model is shared with the other test modules of this process, which run without learning
        costs.set_enabled(False)


def test_no_one_row_steps_for_pinned_requests_or_drafters_off_the_curve_and_no_backoff_pauses_learned() -> None:
    from treedraft.sampling import SamplingParams

    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = costs = step_costs.step_costs_for(m, lat)
    prompt = [1, 5, 9, 5, 9, 5, 9, 3, 5]
    plain = Engine(m).generate(prompt, GenerationConfig(max_new_tokens=60), None).token_ids

    class OffCurve(Oracle):  # same drafts, but sized on no curve
        def __init__(self) -> None:
            super().__init__({1: 1.0}, prompt, plain)

    out = Engine(m).generate(prompt, GenerationConfig(max_new_tokens=60), OffCurve())
    assert all(s.tree_size > 1 for s in out.stats.steps[:-1]) and costs.weight.sum() == 0
    # seeded typical acceptance: its draws depend on its trees, so no exploration steps
    typical = GenerationConfig(max_new_tokens=40, rule="typical", sampling=SamplingParams(temperature=0.8, seed=3))
    eng = Engine(m)
    from treedraft.scheduler import Scheduler

    sched = Scheduler(eng)
    req = sched.add(prompt, typical, Oracle(lat, prompt, plain))
    assert req.pinned
    while not req.done:
        sched.step()
    assert costs.weight[0] == 0  # (drafted steps observed; none of one row)
    seen = costs.weight.sum()

    # logprobs (like a grammar or penalties) make the acceptance the request's own cost: not learned, not explored
    out = Engine(m).generate(prompt, GenerationConfig(max_new_tokens=60, logprobs=2), Oracle(lat, prompt, plain))
    assert out.token_ids == plain and all(s.tree_size > 1 for s in out.stats.steps[:-1])
    assert costs.weight.sum() == seen

    class Wrong(Oracle):  # always rejected: backoff pauses drafting for stretches of one-row steps
        def propose(self, ctx: DraftContext) -> TokenTree:
            self.curve.at(len(ctx.tokens))
            return TokenTree((ctx.root, 10**4 % m.vocab_size), (-1, 0))

    before = costs.weight.copy()
    out = Engine(m).generate(prompt, GenerationConfig(max_new_tokens=60), Wrong(lat, prompt, plain))
    one_row = sum(s.tree_size == 1 for s in out.stats.steps)
    assert out.token_ids == plain and one_row > 8  # mostly paused
    assert costs.weight[0] - before[0] < one_row  # the paused ones are not learned


def test_seeded_sampling_with_learning_and_one_row_steps_equals_seeded_plain() -> None:
    """Coupled seeded draws do not depend on the trees: the learner's one-row steps and its resized trees leave a
    seeded request's tokens those of seeded plain decoding."""
    from treedraft.drafters.suffix import SuffixDrafter
    from treedraft.drafters.suffix_store import SuffixStore
    from treedraft.sampling import SamplingParams

    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = costs = step_costs.step_costs_for(m, lat)
    store = SuffixStore()  # shared, so later requests draft from earlier outputs
    accepted = 0
    for i, sp in enumerate([SamplingParams(1.0, seed=1), SamplingParams(0.7, top_p=0.9, seed=2)] * 2):
        prompt = [(3 * i + 7 * j) % 50 + 1 for j in range(8 + 3 * i)]
        cfg = GenerationConfig(max_new_tokens=48, sampling=sp)
        plain = Engine(m).generate(prompt, cfg, None).token_ids
        d = SuffixDrafter(store, latency=lat, alpha=4.0)
        out = Engine(m).generate(prompt, cfg, d)
        assert out.token_ids == plain, f"seed {sp.seed}: speculative output differs from plain"
        accepted += out.stats.accepted_tokens
        d.finish(prompt, out.token_ids)
    assert costs.weight.sum() > 0 and costs.weight[0] > 0 and accepted > 0  # learned, explored, drafts accepted

"""The scheduler's rate guard (scheduler.GUARD_*): drafting whose steps make fewer tokens per second than plain
one-row steps (the step-cost learner's anchor) pauses, doubling the pause while that lasts."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from treedraft import step_costs
from treedraft.budget import LatencyCurve, MeasuredLatency
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.tiny import tiny_llama
from treedraft.scheduler import GUARD_PAUSE_MAX, GUARD_PAUSE_START, GUARD_STEPS, Request, Scheduler
from treedraft.step_costs import MIN_WEIGHT, StepCosts
from treedraft.tree import TokenTree


@pytest.fixture(autouse=True)
def _learning_on(monkeypatch) -> None:
    monkeypatch.setenv("TREEDRAFT_LEARN_COSTS", "1")  # (the suite's conftest turns it off elsewhere)
    monkeypatch.setenv("TREEDRAFT_RATE_GUARD", "1")


PRIOR = {1: 10.0, 2: 10.5, 4: 12.0, 8: 16.0}


def test_one_row_seconds_is_the_sustained_anchor_once_known() -> None:
    costs = StepCosts(MeasuredLatency(PRIOR))
    assert costs.one_row_seconds(100) is None
    costs.observe(4, 100, 12.0)
    for _ in range(int(MIN_WEIGHT)):
        costs.observe(1, 100, 5.0)  # the first, after a tree, is not the anchor
    assert costs.one_row_seconds(100) is None
    costs.observe(1, 100, 5.0)
    assert costs.one_row_seconds(100) == pytest.approx(5.0)
    costs.set_enabled(False)
    assert costs.one_row_seconds(100) is None


class _Learn:
    def __init__(self, plain: float | None) -> None:
        self.plain = plain

    def one_row_seconds(self, context: int) -> float | None:
        return self.plain


def _window(sched: Scheduler, req: Request, tokens: int, seconds: float) -> None:
    for _ in range(GUARD_STEPS):
        sched._guard(SimpleNamespace(req=req, start=100), tokens, seconds)


def test_a_window_slower_than_plain_pauses_and_the_pause_doubles_until_drafting_pays() -> None:
    sched = Scheduler(Engine(tiny_llama()))
    sched._learn = _Learn(1e-3)  # plain: 1000 tokens/s
    req = sched.add([1, 2, 3], GenerationConfig(max_new_tokens=8), None)
    _window(sched, req, 2, 2.5e-3)  # 800 tokens/s
    assert req.pause == GUARD_PAUSE_START and req.guard_pause == 2 * GUARD_PAUSE_START
    req.pause = 0
    for _ in range(GUARD_STEPS - 1):  # no verdict before a whole window
        sched._guard(SimpleNamespace(req=req, start=100), 2, 2.5e-3)
    assert req.pause == 0
    sched._guard(SimpleNamespace(req=req, start=100), 2, 2.5e-3)
    assert req.pause == 2 * GUARD_PAUSE_START
    for _ in range(10):
        req.pause = 0
        _window(sched, req, 2, 2.5e-3)
    assert req.guard_pause == GUARD_PAUSE_MAX and req.pause == GUARD_PAUSE_MAX
    req.pause = 0
    _window(sched, req, 3, 2.5e-3)  # 1200 tokens/s: drafting pays, the pause starts over
    assert req.pause == 0 and req.guard_pause == GUARD_PAUSE_START


def test_no_verdict_without_an_anchor_or_for_a_pinned_request() -> None:
    sched = Scheduler(Engine(tiny_llama()))
    req = sched.add([1, 2, 3], GenerationConfig(max_new_tokens=8), None)
    sched._learn = _Learn(None)
    _window(sched, req, 1, 1.0)
    assert req.pause == 0 and req.guard == [0.0, 0.0, 0.0]
    sched._learn = _Learn(1e-3)
    from treedraft.sampling import SamplingParams

    typical = GenerationConfig(max_new_tokens=8, rule="typical", sampling=SamplingParams(temperature=0.8, seed=3))
    pinned = sched.add([1, 2, 3], typical, None)
    assert pinned.pinned  # seeded typical acceptance: its draws depend on its trees, which must not depend on timings
    _window(sched, pinned, 1, 1.0)
    assert pinned.pause == 0 and pinned.guard == [0.0, 0.0, 0.0]


class SlowOracle:
    """Drafts the next three tokens of a known greedy output (always accepted), taking ``delay`` seconds to do it."""

    name = "oracle"

    def __init__(self, latency, prompt: list[int], output: list[int], delay: float) -> None:
        self.curve, self.prompt, self.output, self.delay = LatencyCurve(latency), prompt, output, delay

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.curve.at(len(ctx.tokens))  # a drafter sized on the curve
        if self.delay:
            time.sleep(self.delay)
        k = len(ctx.tokens) - len(self.prompt)
        nxt = self.output[k : k + min(3, ctx.max_nodes - 1, ctx.max_depth)]
        return TokenTree((ctx.root, *nxt), (-1, *range(len(nxt))))


@pytest.mark.parametrize("guard", ["1", "0"])
def test_drafting_dearer_than_plain_decoding_pauses_with_the_output_unchanged(monkeypatch, guard) -> None:
    """A drafter right every time but 30 ms slow (a tiny model's one-row step: well under a millisecond) makes
    4 tokens per ~30 ms: the guard pauses it (one-row steps beyond the learner's exploration bursts), greedy output
    unchanged; with the guard off it drafts on. A drafter as right and fast is never paused."""
    monkeypatch.setenv("TREEDRAFT_RATE_GUARD", guard)
    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = step_costs.step_costs_for(m, lat)
    prompt, cfg = [1, 5, 9, 5, 9, 5, 9, 3, 5], GenerationConfig(max_new_tokens=400)
    plain = Engine(m).generate(prompt, cfg, None).token_ids
    slow = Engine(m).generate(prompt, cfg, SlowOracle(lat, prompt, plain, 0.03))
    assert lat.learned.one_row_seconds(60) is not None  # learned from the exploration bursts
    assert slow.token_ids == plain
    one_row = [s.tree_size == 1 for s in slow.stats.steps[:-1]]
    runs = [len(r) for r in "".join("1" if x else "0" for x in one_row).split("0") if r]
    if guard == "1":
        assert max(runs) >= GUARD_PAUSE_START  # a pause: longer than any exploration burst
    else:
        assert max(runs, default=0) <= step_costs.EXPLORE_BURST
    fast = Engine(m).generate(prompt, cfg, SlowOracle(lat, prompt, plain, 0.0))
    assert fast.token_ids == plain
    fast_runs = "".join("1" if s.tree_size == 1 else "0" for s in fast.stats.steps[:-1]).split("0")
    assert max(len(r) for r in fast_runs) <= step_costs.EXPLORE_BURST
    assert math.isfinite(fast.stats.mean_accepted_length) and fast.stats.mean_accepted_length > 3.0

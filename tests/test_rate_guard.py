"""The scheduler's rate guard (scheduler.GUARD_*): drafting whose steps make fewer tokens per second than plain
one-row steps (the step-cost learner's anchor) pauses, doubling the pause while that lasts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from oracle_drafter import Oracle

from treedraft import scheduler, step_costs
from treedraft.budget import MeasuredLatency
from treedraft.engine import Engine, GenerationConfig
from treedraft.models.tiny import tiny_llama
from treedraft.scheduler import GUARD_PAUSE_MAX, GUARD_PAUSE_START, GUARD_STEPS, Request, Scheduler
from treedraft.step_costs import MIN_WEIGHT, StepCosts


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


def _rows(req: Request) -> SimpleNamespace:
    return SimpleNamespace(req=req, start=100, t_draft=0.0, tokens=[0, 0, 0])  # a 3-row step, drafting timed apart


def _window(sched: Scheduler, req: Request, tokens: int, seconds: float) -> None:
    for _ in range(GUARD_STEPS):
        sched._guard(_rows(req), tokens, seconds)


def test_a_window_slower_than_plain_pauses_and_the_pause_doubles_until_drafting_pays() -> None:
    sched = Scheduler(Engine(tiny_llama()))
    sched._learn = _Learn(1e-3)  # plain: 1000 tokens/s
    req = sched.add([1, 2, 3], GenerationConfig(max_new_tokens=8), None)
    _window(sched, req, 2, 2.5e-3)  # 800 tokens/s
    assert req.pause == GUARD_PAUSE_START and req.guard_pause == 2 * GUARD_PAUSE_START
    req.pause = 0
    for _ in range(GUARD_STEPS - 1):  # no verdict before a whole window
        sched._guard(_rows(req), 2, 2.5e-3)
    assert req.pause == 0
    sched._guard(_rows(req), 2, 2.5e-3)
    assert req.pause == 2 * GUARD_PAUSE_START
    for _ in range(10):
        req.pause = 0
        _window(sched, req, 2, 2.5e-3)
    assert req.guard_pause == GUARD_PAUSE_MAX and req.pause == GUARD_PAUSE_MAX
    req.pause = 0
    _window(sched, req, 3, 2.5e-3)  # 1200 tokens/s: drafting pays, the pause starts over
    assert req.pause == 0 and req.guard_pause == GUARD_PAUSE_START
    # a step's drafting counts: 3 tokens in 2.5 ms of forward + 1 ms of drafting is 857 tokens/s
    for _ in range(GUARD_STEPS):
        sched._guard(SimpleNamespace(req=req, start=100, t_draft=1e-3, tokens=[0, 0, 0]), 3, 2.5e-3)
    assert req.pause == GUARD_PAUSE_START
    # a preempted forward counts as GUARD_CAP one-row forwards a row at most: one 1 s step among fast ones
    req.pause, req.guard_pause = 0, GUARD_PAUSE_START
    sched._guard(_rows(req), 3, 1.0)
    for _ in range(GUARD_STEPS - 1):
        sched._guard(_rows(req), 3, 1e-3)
    assert req.pause == 0  # 48 tokens in 15 ms + 12 ms against 48 ms of plain steps
    # the loop's own per-step time is added on both sides: 2 tokens in 2.5 ms beats plain at 1 + 2 ms per token
    sched._loop = 2e-3
    _window(sched, req, 2, 2.5e-3)
    assert req.pause == 0


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


def _runs(steps) -> list[int]:
    """Lengths of the runs of one-row steps (the last step aside: no room for a draft)."""
    return [len(r) for r in "".join("1" if s.tree_size == 1 else "0" for s in steps[:-1]).split("0") if r]


@pytest.mark.parametrize("guard", ["1", "0"])
def test_the_scheduler_pauses_drafting_that_trails_plain_steps_output_unchanged(monkeypatch, guard) -> None:
    """Wiring, independent of this machine's load: the learner's anchor says a plain step costs 1 us, so a drafter
    right every time (4 tokens a step) still trails it: drafting pauses (runs of one-row steps longer than an
    exploration burst, the pauses doubling), greedy output unchanged; with the guard off it drafts on. Said to cost
    a second, plain steps never beat drafting: no pause."""
    monkeypatch.setenv("TREEDRAFT_RATE_GUARD", guard)
    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = step_costs.step_costs_for(m, lat)
    prompt, cfg = [1, 5, 9, 5, 9, 5, 9, 3, 5], GenerationConfig(max_new_tokens=600)
    plain = Engine(m).generate(prompt, cfg, None).token_ids
    monkeypatch.setattr(StepCosts, "one_row_seconds", lambda self, context: 1e-6)
    monkeypatch.setattr(scheduler, "LOOP_ALPHA", 0.0)  # (the loop's own time, added to both sides, stays 0 here)
    out = Engine(m).generate(prompt, cfg, Oracle(lat, prompt, plain))
    assert out.token_ids == plain
    runs = _runs(out.stats.steps)
    if guard == "1":
        assert GUARD_PAUSE_START in runs and 2 * GUARD_PAUSE_START in runs  # the pause, then twice as long
    else:
        assert max(runs, default=0) <= step_costs.EXPLORE_BURST
    monkeypatch.setattr(StepCosts, "one_row_seconds", lambda self, context: 1.0)
    fast = Engine(m).generate(prompt, cfg, Oracle(lat, prompt, plain))
    assert fast.token_ids == plain and max(_runs(fast.stats.steps), default=0) <= step_costs.EXPLORE_BURST


def test_seeded_sampling_paused_by_the_guard_draws_seeded_plain_decodings_tokens(monkeypatch) -> None:
    """Lossless sampling's tokens do not depend on the trees verified (the coupled rule), so the guard's pauses leave a
    seeded request's text as seeded plain decoding's (checked on the bundled model too, session 43: 3 seeds)."""
    from treedraft.sampling import SamplingParams

    m = tiny_llama()
    lat = MeasuredLatency({1: 1e-3, 2: 1.1e-3, 4: 1.2e-3, 8: 1.6e-3})
    lat.learned = step_costs.step_costs_for(m, lat)
    prompt = [1, 5, 9, 5, 9, 5, 9, 3, 5]
    greedy = Engine(m).generate(prompt, GenerationConfig(max_new_tokens=300), None).token_ids
    monkeypatch.setattr(StepCosts, "one_row_seconds", lambda self, context: 1e-6)
    monkeypatch.setattr(scheduler, "LOOP_ALPHA", 0.0)
    paused = []
    guard = Scheduler._guard

    def counted(self, p, tokens: int, seconds: float) -> None:
        before = p.req.guard_pause
        guard(self, p, tokens, seconds)
        paused.append(p.req.guard_pause > before)  # a verdict against drafting (the next pause doubled)

    monkeypatch.setattr(Scheduler, "_guard", counted)
    for seed in (1, 2):
        cfg = GenerationConfig(max_new_tokens=300, sampling=SamplingParams(temperature=0.8, seed=seed))
        plain = Engine(m).generate(prompt, cfg, None).token_ids
        out = Engine(m).generate(prompt, cfg, Oracle(lat, prompt, greedy))
        assert out.token_ids == plain
        assert any(paused)  # the guard paused this request's drafting (beside the failure backoff's pauses)
        paused.clear()

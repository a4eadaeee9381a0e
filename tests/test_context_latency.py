"""The latency curve at the step's context length: tree rows cost more on a longer cache (budget.ContextLatency)."""

from __future__ import annotations

import pickle

import pytest

from treedraft.budget import CHECK_SIZES, CONTEXT_BUCKET, ContextLatency, LatencyCurve
from treedraft.drafters import eagle_tree
from treedraft.drafters.hybrid import HybridDrafter
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree

# shaped like session 15's Zen 4 (ms; convex, so the curve's lower hull keeps every point): at 256 tokens
# 16 rows cost 2.75x one row, at 1,024 tokens 3.9x
SHORT = {1: 4.0, 2: 4.0, 4: 4.4, 8: 6.4, 16: 11.0, 32: 23.0}
LONG = {1: 5.0, 2: 5.6, 4: 6.8, 8: 10.4, 16: 19.6, 32: 39.0}


def lat() -> ContextLatency:
    return ContextLatency(SHORT, 256, LONG, 1024)


def test_at_interpolates_each_row_count_linearly_in_the_context() -> None:
    c = lat()
    assert c.at(256) == SHORT and c.at(1024) == pytest.approx(LONG)
    mid = c.at(640)  # halfway
    assert all(mid[n] == pytest.approx((SHORT[n] + LONG[n]) / 2) for n in SHORT)
    far = c.at(1792)  # extrapolated beyond the long context: the same slope per row count
    assert far[16] == pytest.approx(28.2) and far[1] == pytest.approx(6.0)
    assert c.at(0) == SHORT and c.at(100) == SHORT  # shorter caches: the short curve (see ContextLatency.at)


def test_a_size_measured_faster_on_the_longer_cache_keeps_its_short_time() -> None:
    c = ContextLatency({1: 4.0, 8: 6.0}, 256, {1: 3.5, 8: 9.0}, 1024)  # 1 row: noise made the long one faster
    assert c.at(2048)[1] == 4.0 and c.at(2048)[8] > 9.0


def test_bad_contexts_and_curves_are_refused() -> None:
    with pytest.raises(ValueError, match="long_context"):
        ContextLatency(SHORT, 1024, LONG, 256)
    with pytest.raises(ValueError, match="one-row"):
        ContextLatency(SHORT, 256, {2: 1.0}, 1024)


def test_the_context_curve_is_still_the_short_curve_as_a_dict_and_survives_pickling() -> None:
    c = lat()
    assert dict(c) == SHORT and c[1] == 4.0
    back = pickle.loads(pickle.dumps(c))  # a server worker process receives it this way
    assert back == c and back.at(1024) == pytest.approx(LONG)


def test_latency_curve_at_gives_the_curve_of_that_context_cached_per_bucket() -> None:
    curve = LatencyCurve(lat())
    assert float(curve(16)) == pytest.approx(11.0)
    long = curve.at(1024)
    assert float(long(16)) == pytest.approx(19.6) and float(long(1)) == pytest.approx(5.0)
    assert curve.at(1024 + CONTEXT_BUCKET - 1) is long  # one curve per bucket
    assert curve.at(1024 + CONTEXT_BUCKET) is not long
    plain = LatencyCurve(SHORT)  # one measured context: the same curve everywhere
    assert plain.at(4000) is plain
    eagle = eagle_tree.LatencyCurve(lat())  # a subclass keeps its own smoothing at every context
    assert type(eagle.at(1024)) is eagle_tree.LatencyCurve and float(eagle.at(1024)(8)) == pytest.approx(10.4)


def test_the_suffix_drafter_drafts_shorter_chains_deep_in_a_long_context() -> None:
    """The same 6-token match of a repeated passage: on a short context its chain is priced on the short curve,
    deep in a long one (rows dearer) the chain it drafts is shorter."""
    p = list(range(100, 160))
    filler = list(range(1000, 1000 + 3000))

    def chain_len(prefix: list[int]) -> int:
        d = SuffixDrafter(None, latency=lat(), alpha=4.0, max_spec_tokens=64, max_depth=64)
        toks = prefix + p + [7] + p[:6]
        return len(d.propose(DraftContext(toks, None, 64, 64, 0))) - 1

    short, deep = chain_len([]), chain_len(filler)
    assert 0 < deep < short, (short, deep)
    flat = SuffixDrafter(None, latency=SHORT, alpha=4.0, max_spec_tokens=64, max_depth=64)  # no context model
    toks = filler + p + [7] + p[:6]
    assert len(flat.propose(DraftContext(toks, None, 64, 64, 0))) - 1 == short


class Paid:
    """A member priced like the Medusa heads (node values before drafting)."""

    name = "paid"

    def __init__(self, values: list[float]) -> None:
        self.values, self.draft_cost = values, 0.0

    def node_values(self, max_depth: int) -> list[float]:
        return self.values

    def propose(self, ctx: DraftContext) -> TokenTree:
        n = min(len(self.values), ctx.max_nodes - 1)
        return TokenTree((ctx.root, *range(100, 100 + n)), (-1, *([0] * n)))


def test_the_hybrid_pays_for_fewer_nodes_on_a_long_context() -> None:
    # 3 depth-1 guesses worth 0.3, 0.05, 0.05: on the 256-token curve rows 2-4 cost 0.1 each, all three pay
    # (1.4 / 4.3 > 1.35 / 4.2 > 1.3 / 4.1 > 1 / 4.0); at 2,048 tokens (1 / 2 / 3 / 4 rows: 6.33 / 7.13 / 7.70 /
    # 8.27) only the first does (1.3 / 7.13 > 1.35 / 7.70 > 1.4 / 8.27 and > 1 / 6.33)
    curve = ContextLatency({1: 4.0, 2: 4.1, 4: 4.3}, 256, {1: 5.0, 2: 5.4, 4: 6.0}, 1024)
    h = HybridDrafter([Paid([0.3, 0.05, 0.05])], latency=curve)
    assert len(h.propose(DraftContext([1, 2, 3], None, 8, 4))) == 4
    assert len(h.propose(DraftContext(list(range(2048)), None, 8, 4))) == 2
    flat = HybridDrafter([Paid([0.3, 0.05, 0.05])], latency=dict(curve))  # one curve for every context
    assert len(flat.propose(DraftContext(list(range(2048)), None, 8, 4))) == 4


def test_measured_latency_adds_a_long_context_curve_where_the_cache_holds_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    from treedraft import scheduler
    from treedraft.models import plan
    from treedraft.models.tiny import tiny_llama
    from treedraft.training import calibrate

    monkeypatch.setattr(plan, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(plan, "measured_busy", lambda entry, now=None: False)
    calls = []

    def fake(model, context, sizes, reps):
        if tuple(sizes) != CHECK_SIZES:  # (a cached curve's check in a later call: not a measurement)
            calls.append(context)
        return {n: 0.01 * n + 1e-5 * context * n for n in sizes}  # each row attends to the context

    monkeypatch.setattr(calibrate, "measure_latency", fake)
    big = tiny_llama(seed=0, vocab_size=32, hidden=32, max_seq_len=2048)
    lat = scheduler.measured_latency(big)
    assert isinstance(lat, ContextLatency) and sorted(calls) == [256, 1024]
    assert lat.at(1536)[4] == pytest.approx(0.04 + 1e-5 * 1536 * 4)
    assert scheduler.measured_latency(big) == lat and len(calls) == 2  # both cached
    small = tiny_llama(seed=0, vocab_size=32, hidden=32, max_seq_len=256)  # too small for a second context
    assert not isinstance(scheduler.measured_latency(small), ContextLatency)
    # ... and too small for 256 tokens: its shorter context is measured and cached apart, never read as the
    # 256-token curve of the same model with a larger cache (a --max-seq-len 120 run had overwritten that)
    assert calls == [256, 1024, 191] and scheduler.measured_latency(small)[4] == pytest.approx(0.04 + 1e-5 * 191 * 4)
    assert scheduler.measured_latency(big) == lat and len(calls) == 3


@pytest.fixture()
def curve_check(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A tiny target with a private cache whose forwards 'take' ``now`` (rows -> seconds at any context); counts
    full measurements and checks."""
    from treedraft.models import plan
    from treedraft.models.tiny import tiny_llama
    from treedraft.training import calibrate

    monkeypatch.setattr(plan, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(plan, "measured_busy", lambda entry, now=None: False)
    monkeypatch.setenv("TREEDRAFT_CURVE_CHECK", "1")
    state = {"now": dict(SHORT), "full": 0, "checks": 0, "check_curves": []}

    def fake(model, context, sizes, reps):
        now = state["now"]
        if tuple(sizes) == CHECK_SIZES:
            state["checks"] += 1
            if state["check_curves"]:  # the checks' own curves, one per check, where a test gives them
                now = state["check_curves"].pop(0)
        else:
            state["full"] += 1
        return {n: now.get(n, 0.7 * n) / 1e3 for n in sizes}

    monkeypatch.setattr(calibrate, "measure_latency", fake)
    return tiny_llama(seed=0, vocab_size=32, hidden=32, max_seq_len=2048), state


STEEP = {1: 5.8, 2: 8.6, 4: 12.1, 8: 17.2, 16: 27.3, 32: 52.6}  # a curve cached beside a test run (ms)


def _new_process() -> None:
    from treedraft import budget

    budget._checked.clear()
    budget._spots.clear()


def test_a_cached_curve_of_another_shape_than_a_check_now_is_measured_again(curve_check, capsys) -> None:
    """A curve cached in a slow phase of the host or beside a test run (2 / 4 / 8 rows at 1.48 / 2.08 / 2.96 one-row
    forwards where a later check read 1.05 / 1.08 / 1.59, and the default drafter drafted next to nothing) is
    checked once per process against a few forwards timed now and, when its shape is off, measured again."""
    from treedraft import budget

    model, state = curve_check
    state["now"] = dict(STEEP)
    first = budget.measured_latency(model)  # the first measurement: both contexts, no check
    assert (state["full"], state["checks"]) == (2, 0) and first[4] / first[1] == pytest.approx(12.1 / 5.8)
    _new_process()
    state["now"] = dict(SHORT)  # the machine as it is now
    lat = budget.measured_latency(model)
    assert (state["full"], state["checks"]) == (4, 2)  # checked, confirmed, then both contexts measured again
    assert lat[4] / lat[1] == pytest.approx(4.4 / 4.0) and lat.long[4] / lat.long[1] == pytest.approx(4.4 / 4.0)
    assert "no longer matches this machine (2 rows 1.48x cached vs 1.00x now" in capsys.readouterr().err
    assert budget.measured_latency(model) == lat and (state["full"], state["checks"]) == (4, 2)  # once a process
    _new_process()
    assert budget.measured_latency(model) == lat and (state["full"], state["checks"]) == (4, 3)  # matches: kept
    assert capsys.readouterr().err == ""


def test_a_cached_curve_within_the_checks_noise_or_checked_under_load_is_kept(curve_check, monkeypatch) -> None:
    from treedraft import budget
    from treedraft.models import plan

    model, state = curve_check
    budget.measured_latency(model)
    _new_process()
    state["now"] = {**SHORT, 8: SHORT[8] * 1.25}  # quiet checks spread by up to ~1.2x
    assert budget.measured_latency(model)[8] == pytest.approx(SHORT[8] / 1e3) and state["full"] == 2
    _new_process()
    state["now"] = dict(STEEP)
    monkeypatch.setattr(plan.CpuWindow, "others", lambda self: 1.0)  # another process kept a core busy
    assert budget.measured_latency(model)[8] == pytest.approx(SHORT[8] / 1e3) and state["full"] == 2


def test_curve_disagreement_is_the_worst_ratio_factor() -> None:
    from treedraft.budget import curve_disagreement

    assert curve_disagreement(SHORT, SHORT) == 1.0
    assert curve_disagreement(SHORT, {k: 2 * v for k, v in SHORT.items()}) == pytest.approx(1.0)  # scale: no matter
    assert curve_disagreement(STEEP, {1: 4.0, 2: 4.2, 8: 6.4}) == pytest.approx((17.2 / 5.8) / (6.4 / 4.0))
    assert curve_disagreement({1: 1.0, 8: 2.0}, {1: 1.0, 4: 2.0}) == pytest.approx(2.0 / (1.0 + 3 / 7))  # interpolated


def test_a_check_that_met_noise_does_not_replace_the_curve(curve_check, capsys) -> None:
    """A disagreeing first check is confirmed by more rounds (each size's fastest over both), and a check whose
    k-row forward came out faster than 0.9 one-row forwards (its one-row rounds met a burst: 2 rows at 0.70x was
    seen right after a load here) is not acted on: re-measuring in such a moment would store a worse curve."""
    from treedraft import budget

    model, state = curve_check
    budget.measured_latency(model)  # SHORT cached
    assert "measuring this machine's forward latency" in capsys.readouterr().err  # a first measurement says so
    _new_process()
    state["check_curves"] = [dict(STEEP), dict(SHORT)]  # a burst in the first check only: the confirmation agrees
    assert budget.measured_latency(model)[2] == pytest.approx(SHORT[2] / 1e3)
    assert (state["full"], state["checks"]) == (2, 2)
    _new_process()
    burst = {1: 6.1, 2: 4.3, 4: 4.5, 8: 6.5}  # one row slower than two: not a forward's cost
    state["check_curves"] = [dict(burst), dict(burst)]
    assert budget.measured_latency(model)[2] == pytest.approx(SHORT[2] / 1e3)
    assert (state["full"], state["checks"]) == (2, 3) and capsys.readouterr().err == ""

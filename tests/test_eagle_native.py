"""EAGLE draft step as one native call (drafters/eagle_native.py) and expected-gain tree sizing
(drafters/eagle_tree.py), on tiny seeded models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from spec_stats import one_thread  # noqa: F401
from test_eagle import cfg, random_net

from treedraft.drafters.eagle import EagleDrafter, fast_drafting
from treedraft.drafters.eagle_tree import LatencyCurve, best_size, choose_size, worth_expanding
from treedraft.engine import Engine
from treedraft.interfaces import DraftContext

pytestmark = pytest.mark.usefixtures("one_thread")

# this CPU's int4 verify curve at 256-token context (seconds), quiet: steep, as the sizing must handle
XEON = {1: 0.0108, 2: 0.0119, 4: 0.0191, 8: 0.0293, 16: 0.0518, 32: 0.0909}


def native_setup(seed: int = 5):
    from test_batch import native_tiny

    from treedraft.drafters.eagle_native import native_draft_step

    model = native_tiny(seed=seed)
    net = random_net(model, 2, draft_vocab=24, depth=3, topk=3)
    fast, head, vocab = fast_drafting(net, model)
    step = native_draft_step(fast, head)
    if step is None:
        pytest.skip("native extension without the EAGLE input")
    return model, fast, head, vocab, step


def test_native_step_equals_the_pytorch_path_over_the_same_q8_linears() -> None:
    """Commit (causal) then a masked tree depth: features, head logits and the draft cache's k/v agree with
    the PyTorch forward of the same native-linear net (float rounding only)."""
    model, fast, head, vocab, step = native_setup()
    toks = [1, 2, 3, 4, 5, 6, 7]
    _, hid = model.forward(torch.tensor([toks[:-1]]), torch.arange(6))
    feats, x = hid[0].contiguous(), torch.tensor(toks[1:])
    c_py, c_nat = fast.new_cache(32), fast.new_cache(32)
    want = fast(feats[None], x[None], torch.arange(6), c_py, 0)[0]
    lg, got = step(feats, x, torch.arange(6), c_nat, 0, None, torch.tensor([5]))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lg, head(want[-1:]).float(), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(c_nat.k[0][:, :, :6], c_py.k[0][:, :, :6], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(c_nat.v[0][:, :, :6], c_py.v[0][:, :, :6], atol=2e-4, rtol=2e-4)
    # a tree depth: 3 rows at slots 6..8, row 2 also sees row 0's slot (its parent), rows see the 6 committed
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[:, :6] = True
    mask[torch.arange(3), 6 + torch.arange(3)] = True
    mask[2, 6] = True
    f3, t3, p3 = want[[5, 5, 4]].contiguous(), torch.tensor([9, 10, 11]), torch.tensor([6, 6, 7])
    want3 = fast(f3[None], t3[None], p3, c_py, 6, mask)[0]
    lg3, got3 = step(f3, t3, p3, c_nat, 6, mask, None)
    torch.testing.assert_close(got3, want3, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lg3, head(want3).float(), atol=2e-4, rtol=2e-4)
    # the mask matters: without row 2's parent slot its output differs
    mask[2, 6] = False
    _, other = step(f3, t3, p3, c_nat, 6, mask, None)
    assert not torch.allclose(other[2], got3[2], atol=1e-3) and torch.allclose(other[:2], got3[:2])


def test_native_drafter_proposes_like_the_pytorch_drafter_and_greedy_equals_plain(tmp_path: Path) -> None:
    model, fast, head, vocab, step = native_setup()
    toks = [1, 2, 3, 4, 5, 6]
    _, hid = model.forward(torch.tensor([toks[:-1]]), torch.arange(5))
    ctx = DraftContext(toks, hid[0, -1], 12, 3, 5, hid[0])
    want = EagleDrafter(fast, max_len=64, project=head, project_vocab=vocab).propose(ctx)
    got = EagleDrafter(fast, max_len=64, project=head, project_vocab=vocab, native=step).propose(ctx)
    assert got.tokens == want.tokens and got.parents == want.parents and len(got) == 12
    engine = Engine(model)
    ref = engine.generate([5, 3, 8, 1], cfg(24), None).token_ids
    d = EagleDrafter(fast, max_len=128, project=head, project_vocab=vocab, native=step)
    assert engine.generate([5, 3, 8, 1], cfg(24, max_tree_nodes=8), d).token_ids == ref


def test_for_target_drafts_natively_and_sizes_by_the_given_latency(tmp_path: Path) -> None:
    model, fast, head, vocab, step = native_setup()
    net = random_net(model, 2, draft_vocab=24, depth=3, topk=3)
    net.save(tmp_path)
    d = EagleDrafter.for_target(model, tmp_path, latency=XEON)
    assert d.native is not None and d.curve is not None
    engine = Engine(model)
    ref = engine.generate([5, 3, 8, 1], cfg(24), None).token_ids
    assert engine.generate([5, 3, 8, 1], cfg(24, max_tree_nodes=16), d).token_ids == ref
    with pytest.raises(ValueError, match="latency must be"):
        EagleDrafter.for_target(model, tmp_path, latency="fast")


def test_for_target_drafts_natively_on_a_float32_target_too(tmp_path: Path) -> None:
    """A net with its own draft vocabulary needs nothing of the target's lm_head: on a --weights fp32 target (float
    lm_head, row-invariant fp32 kernels) it drafts natively and sizes its trees. It used to draft through PyTorch
    and verify whole unsized trees there: 0.66x plain on SmolLM2 fp32, 1.41x with this (10 MT-Bench x 128)."""
    from native_utils import tiny_config

    from treedraft.models.llama import Transformer
    from treedraft.models.plan import pack_tuned
    from treedraft.models.quant import QuantLinear, native_kernels

    if native_kernels() is None:
        pytest.skip("native extension unavailable")
    torch.manual_seed(3)
    model = Transformer(tiny_config(256, 64)).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.12)
    pack_tuned(model, tmp_path / "model", torch.float32)  # as a --weights fp32 load packs it
    assert not isinstance(model.lm_head, QuantLinear)
    random_net(model, 2, draft_vocab=24, depth=3, topk=3).save(tmp_path / "eagle")
    d = EagleDrafter.for_target(model, tmp_path / "eagle", latency=XEON)
    assert d.native is not None and d.curve is not None
    engine = Engine(model)
    ref = engine.generate([5, 3, 8, 1], cfg(24), None).token_ids
    assert engine.generate([5, 3, 8, 1], cfg(24, max_tree_nodes=16), d).token_ids == ref
    # the full vocabulary projects through the target's lm_head: nothing native to draft with on a float one
    random_net(model, 2, draft_vocab=0, depth=3, topk=3).save(tmp_path / "full")
    assert EagleDrafter.for_target(model, tmp_path / "full", latency=XEON).native is None


# ---- expected-gain sizing ---------------------------------------------------------------------
def brute_best(v: list[float], lat, draft: float) -> int:
    rates = [(1 + sum(v[:n])) / (lat(n + 1) + draft) for n in range(len(v) + 1)]
    return max(range(len(rates)), key=lambda n: (rates[n], -n))


@pytest.mark.parametrize(
    "values", [[0.9, 0.8, 0.7, 0.5, 0.3, 0.1], [0.05, 0.01], [0.99, 0.98, 0.97, 0.96], [0.5] * 20, []]
)
@pytest.mark.parametrize("draft", [0.0, 0.003])
def test_best_size_maximises_expected_tokens_per_second(values: list[float], draft: float) -> None:
    curve = LatencyCurve(XEON)
    n = best_size(np.array(values), curve, draft, len(values))
    assert n == brute_best(values, lambda r: float(curve(r)), draft)


def test_best_size_on_this_cpu_curve_small_trees_and_none_for_weak_drafts() -> None:
    curve = LatencyCurve(XEON)
    assert best_size(np.array([0.05, 0.02, 0.01]), curve, 0.001, 3) == 0  # plain beats a weak draft
    assert best_size(np.array([0.45, 0.2, 0.1, 0.05]), curve, 0.001, 4) == 1  # 2 rows ~ free, 4 rows are not
    flat = LatencyCurve({1: 0.01, 64: 0.0100001})
    assert best_size(np.array([0.3] * 10), flat, 0.0, 10) == 10  # rows free: take everything
    assert best_size(np.array([0.3] * 10), flat, 0.0, 4) == 4  # ... within the budget


def test_latency_curve_interpolates_and_rejects_bad_curves() -> None:
    c = LatencyCurve({1: 0.01, 4: 0.02, 8: 0.03})
    assert float(c(2)) == pytest.approx(0.01 + 0.01 / 3) and float(c(16)) == pytest.approx(0.05)
    assert float(LatencyCurve({1: 0.02, 2: 0.01})(2)) == 0.02  # never cheaper with more rows
    for bad in ({}, {2: 0.01}, {1: 0.0}):
        with pytest.raises(ValueError):
            LatencyCurve(bad)


def test_worth_expanding_only_when_a_frontier_node_could_pay() -> None:
    curve = LatencyCurve(XEON)
    assert worth_expanding(np.array([0.9, 0.1]), 0.9, curve, 0.001, 0.0005)
    assert not worth_expanding(np.array([0.02, 0.01]), 0.02, curve, 0.001, 0.0005)


def test_sized_tree_is_a_prefix_of_the_full_tree_and_smaller_on_a_steep_curve() -> None:
    from test_eagle import tiny

    model = tiny(3)
    net = random_net(model, 4, draft_vocab=20, depth=4, topk=3)
    toks = [1, 2, 3, 4, 5, 6]
    _, hid = model.forward(torch.tensor([toks[:-1]]), torch.arange(5))
    ctx = DraftContext(toks, hid[0, -1], 24, 4, 5, hid[0])
    full = EagleDrafter(net, max_len=128).propose(ctx)
    steep = EagleDrafter(net, max_len=128, latency={1: 0.01, 2: 0.02, 4: 0.04, 64: 0.64}).propose(ctx)
    flat = EagleDrafter(net, max_len=128, latency={1: 0.01, 64: 0.01}, draft_step_seconds=0.0).propose(ctx)
    assert len(steep) < len(full) == 24 and len(flat) == 24
    assert steep.tokens == full.tokens[: len(steep)] and steep.parents == full.parents[: len(steep)]
    assert flat.tokens == full.tokens and flat.parents == full.parents


class SkipCheck:
    """Wraps an EagleDrafter; records drafted / skipped steps and, after every drafted one, that the draft cache
    equals a fresh recompute of all committed pairs (held-back features of skipped steps included)."""

    name = "eagle-skip-check"

    def __init__(self, model, drafter: EagleDrafter) -> None:
        self.model, self.d, self.drafted, self.skipped = model, drafter, 0, 0

    def propose(self, ctx: DraftContext):
        tree = self.d.propose(ctx)
        r = len(ctx.tokens) - 1
        if self.d.committed < r:
            assert self.d._pending is not None and self.d._pending[1] == self.d.committed
            self.skipped += 1
            return tree
        self.drafted += 1
        _, hid = self.model.forward(torch.tensor([ctx.tokens[:r]]), torch.arange(r))
        fresh = self.d.net.new_cache(r)
        self.d.net(hid, torch.tensor([ctx.tokens[1 : r + 1]]), torch.arange(r), fresh, 0)
        torch.testing.assert_close(self.d.cache.k[0][:, :, :r], fresh.k[0][:, :, :r], atol=1e-4, rtol=1e-4)
        return tree


def test_weak_draft_backs_off_and_catches_up_its_cache_exactly() -> None:
    """A random draft on a steep curve does not pay: the drafter skips steps (doubling back-off), holds their
    features and commits them at the next drafted step; output = plain; its calibration falls below 1."""
    from test_eagle import tiny

    from treedraft.drafters.hybrid import HybridDrafter

    model = tiny(2)
    engine = Engine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = engine.generate(prompt, cfg(40), None).token_ids
    d = EagleDrafter(random_net(model, 1, depth=3, topk=2), max_len=128, latency=XEON, draft_step_seconds=0.003)
    check = SkipCheck(model, d)
    r = engine.generate(prompt, cfg(40, max_tree_nodes=8), HybridDrafter([check]))
    assert r.token_ids == ref
    assert check.skipped >= 3 and check.drafted >= 3
    assert d.calibration < 1.0


def test_choose_size_says_whether_drafting_paid() -> None:
    curve = LatencyCurve(XEON)
    assert choose_size(np.array([0.9, 0.5]), curve, 0.001) == (1, True)
    n, paid = choose_size(np.array([0.15]), curve, 0.002)  # 1.15 tokens for 11.9 + 2 ms vs 1 for 10.8 ms
    assert not paid and n in (0, 1)


def test_measured_latency_is_measured_once_and_feeds_step_rows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from test_eagle import tiny

    from treedraft import scheduler
    from treedraft.models import plan
    from treedraft.training import calibrate

    monkeypatch.setattr(plan, "cache_dir", lambda: tmp_path)  # (TREEDRAFT_CACHE would rebuild the kernels)
    monkeypatch.setattr(plan, "measured_busy", lambda entry, now=None: False)
    calls = []

    def fake(model, context, sizes, reps):
        calls.append(context)
        return {n: 0.01 * (1 + (n > 2) * n) for n in sizes}

    monkeypatch.setattr(calibrate, "measure_latency", fake)
    model = tiny(1)
    lat = scheduler.measured_latency(model)
    assert lat[1] == 0.01 and lat[4] == pytest.approx(0.05) and len(calls) == 1
    assert scheduler.measured_latency(model) == lat and len(calls) == 1  # cached
    assert scheduler.measured_step_rows(model) == scheduler.step_rows_from_latency(lat) == 2


def test_a_target_off_the_cpu_never_drafts_through_the_native_cpu_kernels() -> None:
    """The native kernels are CPU code: an EAGLE net with its own draft vocabulary beside a CUDA target went native
    anyway (quantized copies of CUDA weights fed to the CPU kernels) and the GPU check crashed with a segfault."""
    from native_utils import tiny_config

    from treedraft.models.llama import Transformer
    from treedraft.models.quant import native_kernels

    if native_kernels() is None:
        pytest.skip("native extension unavailable (nothing native to refuse)")
    model = Transformer(tiny_config(256, 64)).eval().requires_grad_(False)
    net = random_net(model, 2, draft_vocab=24, depth=3, topk=3)

    class OnGpu:  # the target as the drafter sees it: its lm_head and the device it reports
        lm_head = model.lm_head
        device = torch.device("cuda")

    fast, lm, vocab = fast_drafting(net, OnGpu())
    assert fast is net and lm is None and vocab is None

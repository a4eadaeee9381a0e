"""EAGLE as a paid member of the hybrid drafter: per-rank acceptance (node values), drafting cost per node
count, the cached per-machine cost, idle steps that keep the draft cache exact, the pruned tree search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_eagle import cfg, random_net, tiny
from test_hybrid_paid import CURVE, Valued

from treedraft.budget import LatencyCurve
from treedraft.drafters import eagle_tree
from treedraft.drafters.eagle import EagleDrafter
from treedraft.drafters.eagle_cost import EAGLE_DRAFT_COST_KIND, eagle_draft_costs_on_curve
from treedraft.drafters.eagle_tree import RankAcceptance, accepted_nodes, prior_values
from treedraft.drafters.hybrid import HybridDrafter, paid_nodes
from treedraft.engine import Engine
from treedraft.interfaces import DraftContext
from treedraft.tree import TokenTree


def test_paid_nodes_prices_each_node_count_with_its_own_drafting_cost() -> None:
    c = LatencyCurve(CURVE)
    # plain 1/10; one node 1.6 / (11 + 1) = 0.133; two 1.9 / (14 + 1) = 0.127 (3 rows = 14 on the hull)
    assert paid_nodes([0.6, 0.3], gain=1.0, rows=1, miss=1.0, draft_cost=1.0, curve=c) == 1
    # rows free (a flat curve): only the drafting cost of each node count decides
    flat = LatencyCurve({1: 10.0, 64: 10.0})
    assert paid_nodes([0.6, 0.3, 0.2], 1.0, 1, 1.0, [1.0, 1.0, 1.0], flat) == 3  # 2.1 / 11
    # each further node needs one more draft forward of 6 s: (1.6)/11 = 0.145 > 1.9/17 = 0.112 > 2.1/23
    assert paid_nodes([0.6, 0.3, 0.2], 1.0, 1, 1.0, [1.0, 7.0, 13.0], flat) == 1
    # the deep node alone is too dear: 2 nodes (1.9 / 11 = 0.173) beat 3 (2.1 / 40 = 0.053)
    assert paid_nodes([0.6, 0.3, 0.2], 1.0, 1, 1.0, [1.0, 1.0, 30.0], flat) == 2
    with pytest.raises(ValueError, match="draft_cost gives 2 costs for 3 node values"):
        paid_nodes([0.6, 0.3, 0.2], 1.0, 1, 1.0, [1.0, 1.0], flat)


def test_rank_acceptance_follows_the_verified_trees_from_the_prior() -> None:
    ra = RankAcceptance(4, np.array([0.5, 0.2, 0.1, 0.05]))
    assert ra.values() == pytest.approx([0.5, 0.2, 0.1, 0.05])
    for _ in range(60):  # rank 0 always accepted, rank 1 never, ranks 2-3 never offered (trees of 2 nodes)
        ra.add(2, [0])
    v = ra.values()
    assert v[0] > 0.9 and v[1] < 0.05
    assert v[2] == pytest.approx(min(0.1, v[1])) and v[3] <= v[2]  # never offered: prior, made non-increasing
    ra.add(4, [0, 3])  # rank 3 accepted once: counts only where the tree had that rank
    assert ra.hits[3] == 1.0 and ra.seen[3] == 1.0 and ra.seen[1] > 20


def test_accepted_nodes_walks_the_committed_tokens_down_the_tree() -> None:
    tree = TokenTree((9, 5, 6, 7, 8), (-1, 0, 0, 1, 2))  # 5 -> 7, 6 -> 8
    assert accepted_nodes(tree, [6, 8]) == [1, 3]
    assert accepted_nodes(tree, [5, 8]) == [0]  # 8 is not a child of 5
    assert accepted_nodes(tree, [4]) == [] and accepted_nodes(tree, []) == []


def test_prior_values_chain_the_held_out_top1() -> None:
    model = tiny(3)
    net = random_net(model, 4, depth=3, topk=2)
    c = net.config
    object.__setattr__(c, "extra", {"training": {"epochs": [{"heldout_top1": [0.5, 0.4]}]}})
    assert prior_values(c, 4) == pytest.approx([0.5, 0.2, 0.1, 0.05])
    object.__setattr__(c, "extra", {})
    assert prior_values(c, 2) == pytest.approx([0.5, 0.25])


def _drafter(**kw) -> tuple[torch.nn.Module, EagleDrafter]:
    model = tiny(3)
    return model, EagleDrafter(random_net(model, 4, draft_vocab=20, depth=4, topk=3), max_len=128, **kw)


def test_node_values_and_draft_cost_per_node_count() -> None:
    model, d = _drafter()
    d.draft_costs = (0.002, 0.001)
    assert d.draft_cost_for(1) == pytest.approx(0.002)
    assert d.draft_cost_for(3) == pytest.approx(0.004)  # depths 2 and 3 reachable by 3 nodes
    assert d.draft_cost_for(20) == pytest.approx(0.005)  # at most depth 4
    vals = d.node_values(8)
    assert len(vals) == d.cal.ranks.size and all(a >= b for a, b in zip(vals, vals[1:]))
    # a verified tree whose best node was accepted raises rank 0's value
    toks = [1, 2, 3, 4, 5, 6]
    _, hid = model.forward(torch.tensor([toks[:-1]]), torch.arange(5))
    tree = d.propose(DraftContext(toks, hid[0, -1], 4, 4, 5, hid[0]))
    before = d.node_values(8)[0]
    nxt = toks + [tree.tokens[1], 7]  # the rank-0 node accepted, then the bonus token
    _, hid2 = model.forward(torch.tensor([nxt[:-1]]), torch.arange(len(nxt) - 1))
    d.propose(DraftContext(nxt, hid2[0, -1], 4, 4, 5, hid2[0, -2:]))
    assert d.node_values(8)[0] > before
    assert d.cal.ranks.hits[0] == pytest.approx(1.0) and d.cal.ranks.seen[2] == pytest.approx(1.0)


def _counting(run, seen: list[int]):
    """``run`` (an EagleDrafter._run) recording the rows of each draft forward into ``seen``."""

    def counted(*a, **k):
        seen.append(a[0].shape[0])
        return run(*a, **k)

    return counted


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 9, 14])
def test_pruned_search_keeps_the_same_tree_with_fewer_draft_forwards(budget: int, monkeypatch) -> None:
    """Frontier nodes ranked at or below the budget-th node are not expanded (their children cannot be kept)."""
    model = tiny(3)
    net = random_net(model, 4, draft_vocab=20, depth=4, topk=3)
    trees, rows = {}, {}
    for prune in (True, False):
        d = EagleDrafter(net, max_len=128)
        if not prune:
            monkeypatch.setattr(eagle_tree, "prune_cut", lambda score, budget: None)
        seen: list[int] = []
        d._run = _counting(d._run, seen)  # type: ignore[method-assign]
        for n in (5, 7):
            toks = [1, 2, 3, 4, 5, 6, 7, 8][: n + 1]
            _, hid = model.forward(torch.tensor([toks[:-1]]), torch.arange(n))
            d.reset()
            trees[prune, n] = d.propose(DraftContext(toks, hid[0, -1], budget + 1, 4, n, hid[0]))
        rows[prune] = sum(seen)
        monkeypatch.undo()
    for n in (5, 7):
        assert trees[True, n].tokens == trees[False, n].tokens and trees[True, n].parents == trees[False, n].parents
    # fewer draft rows wherever the kept tree is smaller than what the search would draft (budget 1 is depth 1
    # either way; 9 and 14 keep nodes from every depth here)
    assert rows[True] < rows[False] if budget in (2, 3, 5) else rows[True] == rows[False]


class Leader(Valued):
    """A scored member that leads (3 expected tokens) every other step, so the hybrid skips EAGLE there."""

    def __init__(self) -> None:
        super().__init__([], [])
        self.calls = 0

    def propose_valued(self, ctx: DraftContext):
        self.calls += 1
        if self.calls % 2:
            return TokenTree.chain(ctx.root, [0, 0, 0]), [1.0, 1.0, 1.0]
        return TokenTree((ctx.root,), (-1,)), []


def test_idle_steps_keep_the_draft_cache_equal_to_a_fresh_recompute() -> None:
    """In a paid hybrid, steps EAGLE is not run feed its committed features at its next propose: its cache then
    equals a fresh recompute of every committed pair (without idle() it would start over from the last step)."""
    model = tiny(2)
    engine = Engine(model)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = engine.generate(prompt, cfg(30), None).token_ids
    checked: list[int] = []

    class Checked(EagleDrafter):
        """After every propose (of this drafter or its per-request twin), the cache check."""

        def propose(self, ctx: DraftContext) -> TokenTree:
            tree = super().propose(ctx)
            r = len(ctx.tokens) - 1
            assert self.base == 0 and self.committed == r
            _, hid = model.forward(torch.tensor([ctx.tokens[:r]]), torch.arange(r))
            fresh = self.net.new_cache(r)
            self.net(hid, torch.tensor([ctx.tokens[1 : r + 1]]), torch.arange(r), fresh, 0)
            torch.testing.assert_close(self.cache.k[0][:, :, :r], fresh.k[0][:, :, :r], atol=1e-4, rtol=1e-4)
            checked.append(r)
            return tree

    d = Checked(random_net(model, 1, depth=3, topk=2), max_len=128)
    flat = {1: 1.0, 64: 1.0}  # rows and drafting free: EAGLE is asked whenever the leader does not lead
    h = HybridDrafter([d, Leader()], lead_extra=0, latency=flat)
    r = engine.generate(prompt, cfg(30, max_tree_nodes=8), h)
    assert r.token_ids == ref
    assert len(checked) >= 5 and len(r.stats.steps) >= len(checked) + 5  # EAGLE skipped on about half the steps


def test_eagle_draft_cost_is_measured_once_per_machine_and_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    model, d = _drafter(latency={1: 0.01, 4: 0.02})
    calls = {"n": 0}
    real = EagleDrafter.propose

    def counting(self, ctx):
        calls["n"] += 1
        return real(self, ctx)

    monkeypatch.setattr(EagleDrafter, "propose", counting)
    first, depth = eagle_draft_costs_on_curve(model, d, 0.01, reps=3)
    assert calls["n"] == 1 + 2 * 4 and first > 0.0 and depth >= 0.0  # the prompt's commit + 4 pairs of timed steps
    assert d.cache.length == 0 and d.cal.ranks.seen.sum() == 0  # measured on a twin: the drafter learned nothing
    again = eagle_draft_costs_on_curve(model, d, 0.02, reps=3)
    assert calls["n"] == 9  # read from the cache, not measured again
    assert again == pytest.approx((2 * first, 2 * depth))  # the cached ratios, scaled by this one-row time
    (entry,) = (tmp_path / "cache" / "tune").glob(f"{EAGLE_DRAFT_COST_KIND}-*.json")
    entry.write_text("{not json")  # a corrupt entry is measured again, not a crash
    eagle_draft_costs_on_curve(model, d, 0.01, reps=3)
    assert calls["n"] == 18


# ---- the shipped drafter on the real model ---------------------------------------------------
@pytest.mark.slow
def test_hybrid_eagle_greedy_equals_plain_real_model(smollm_int4) -> None:
    """hybrid-eagle (EAGLE paid + suffix) on the real int4 model: output = plain, a first turn and the same
    question again (the suffix member then leads with its chains and EAGLE idles), drafts accepted."""
    from treedraft.drafters.eagle import shipped_eagle_for

    if shipped_eagle_for("smollm2-135m-instruct") is None:
        pytest.skip("no shipped EAGLE drafter")
    llm = smollm_int4
    h = llm.drafters.get("hybrid-eagle")
    assert isinstance(h, HybridDrafter) and isinstance(h.drafters[0], EagleDrafter)
    assert h.drafters[0].draft_costs[0] > 0.0  # priced by this machine's cached measurement
    # each reports the name it was asked by (the CLI's stats line, the server's treedraft.drafter field)
    assert (h.name, llm.drafters.get("eagle-lookup").name) == ("hybrid-eagle", "eagle-lookup")
    for q in ("Write a short poem about the sea.", "Explain what a hash table is."):
        plain = llm.generate(q, drafter=None, max_new_tokens=64)
        for turn in ("first", "repeat"):
            spec = llm.generate(q, drafter=h, max_new_tokens=64)
            assert spec.token_ids == plain.token_ids
            # a first turn: drafts were proposed and accepted (how many is the paid gate's choice from this
            # machine's measured latency curve and draft costs: 1.05 on a Zen 5 whose curve was measured
            # beside the other pytest worker); a repeat: the suffix member's chains carry most of the answer
            if turn == "first":
                assert sum(s.accepted for s in spec.stats.steps) > 0
            else:
                assert spec.stats.mean_accepted_length > 1.1


def test_fresh_forgets_what_the_verified_trees_taught_and_leaves_the_original_alone() -> None:
    """fresh() (bench --fresh-drafter-state) restarts the per-rank acceptance and the calibration, also inside a
    hybrid; for_request() twins keep sharing the learned ranks."""
    from treedraft.drafters.hybrid import fresh_copy

    model, d = _drafter()
    prior = d.node_values(8)
    for _ in range(40):  # rank 0 always accepted, ranks 1-2 never
        d.cal.ranks.add(3, [0])
    d.cal.acc, d.cal.exp = 30.0, 60.0
    learned = d.node_values(8)
    assert learned != pytest.approx(prior) and d.cal.factor < 0.6
    twin = d.for_request()
    assert twin.cal.ranks is d.cal.ranks  # requests share what was learned
    new = d.fresh()
    assert new.node_values(8) == pytest.approx(prior) and new.cal.factor == pytest.approx(1.0)
    assert new.cache is not d.cache and new.net is d.net and new.native is d.native
    assert d.node_values(8) == pytest.approx(learned) and d.cal.factor < 0.6  # the original keeps its state
    hyb = fresh_copy(HybridDrafter([d], name="h"))
    assert hyb.drafters[0] is not d and hyb.drafters[0].node_values(8) == pytest.approx(prior)

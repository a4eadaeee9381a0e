"""Paid members of the hybrid drafter: the Medusa heads draft only the nodes that pay for their rows and time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from treedraft.budget import LatencyCurve
from treedraft.drafters import registry
from treedraft.drafters.hybrid import HybridDrafter, paid_nodes
from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.drafters.suffix import SuffixDrafter
from treedraft.drafters.suffix_store import SuffixStore
from treedraft.engine import Engine, GenerationConfig
from treedraft.interfaces import DraftContext
from treedraft.models.tiny import tiny_llama
from treedraft.tree import TokenTree

# seconds by rows (root included), shaped like the Xeon int4 curve: the 2nd row nearly free, later ones ~1/3 step;
# its lower hull drops 4 rows (19.0 lies above the 2 -> 8 segment): 3 rows = 14.0
CURVE = {1: 10.0, 2: 11.0, 4: 19.0, 8: 29.0}


def test_paid_nodes_keeps_the_prefix_that_maximises_tokens_per_second() -> None:
    c = LatencyCurve(CURVE)
    # nothing else drafted: 1/10 plain; one node 1.5/(11+1) = 0.125; two 1.6/(14+1) = 0.107 -> 1
    assert paid_nodes([0.5, 0.1], gain=1.0, rows=1, miss=1.0, draft_cost=1.0, curve=c) == 1
    # drafting dearer than what the node returns: 1.5/(11+5) < 0.1 -> not run
    assert paid_nodes([0.5, 0.1], gain=1.0, rows=1, miss=1.0, draft_cost=5.0, curve=c) == 0
    # next to a scored node (2 rows already, its guess right half the time): the third row does not pay
    assert paid_nodes([0.5], gain=1.5, rows=2, miss=0.5, draft_cost=1.0, curve=c) == 0
    # free rows and drafting: every node with a value pays
    flat = LatencyCurve({1: 1.0, 64: 1.0})
    assert paid_nodes([0.5, 0.1, 0.05], gain=1.0, rows=1, miss=1.0, draft_cost=0.0, curve=flat) == 3
    assert paid_nodes([], gain=1.0, rows=1, miss=1.0, draft_cost=0.0, curve=flat) == 0


class Paid:
    """A member priced like the Medusa heads: node values known before drafting; records the budgets it got."""

    name = "paid"

    def __init__(self, values: list[float], cost: float = 0.0) -> None:
        self.values, self.draft_cost, self.asked = values, cost, []

    def node_values(self, max_depth: int) -> list[float]:
        return self.values

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.asked.append(ctx.max_nodes)
        n = min(len(self.values), ctx.max_nodes - 1)
        return TokenTree((ctx.root, *range(100, 100 + n)), (-1, *([0] * n)))


class Valued:
    """A member that values its nodes (like ``suffix``): a fixed chain."""

    name = "valued"

    def __init__(self, tokens: list[int], values: list[float]) -> None:
        self.tokens, self.values = tokens, values

    def propose_valued(self, ctx: DraftContext) -> tuple[TokenTree, list[float]]:
        n = len(self.tokens)
        return TokenTree((ctx.root, *self.tokens), (-1, *range(n))), list(self.values)

    def propose_scored(self, ctx: DraftContext) -> tuple[TokenTree, float]:
        tree, values = self.propose_valued(ctx)
        return tree, sum(values)

    def propose(self, ctx: DraftContext) -> TokenTree:
        return self.propose_valued(ctx)[0]


def _ctx(max_nodes: int = 64) -> DraftContext:
    return DraftContext([1, 2, 3], None, max_nodes=max_nodes, max_depth=8)


def test_a_paid_member_drafts_only_where_the_scored_members_have_nothing() -> None:
    paid = Paid([0.5, 0.1], cost=1.0)
    h = HybridDrafter([paid, Valued([], [])], latency=CURVE)
    tree = h.propose(_ctx())
    assert paid.asked == [2] and tree.tokens == (3, 100)  # its one paying node, asked for just that
    paid.asked.clear()
    h = HybridDrafter([paid, Valued([7], [0.5])], latency=CURVE)  # a scored node: the third row would not pay
    assert h.propose(_ctx()).tokens == (3, 7) and paid.asked == []
    # without the curve the member drafts its whole tree next to the scored one, as before
    h = HybridDrafter([paid, Valued([7], [0.5])])
    assert h.propose(_ctx()).tokens == (3, 100, 101, 7) and paid.asked == [64]


def test_in_a_batched_step_a_paid_member_is_weighed_against_the_whole_step() -> None:
    """Alone, the heads' paying node is drafted; in a step that also verifies 7 other requests' rows, the same
    node (its row and its propose delay every request) does not pay, and the member is not run at all."""
    paid = Paid([0.5, 0.1], cost=1.0)
    h = HybridDrafter([paid, Valued([], [])], latency=CURVE)
    assert h.propose(_ctx()).tokens == (3, 100) and paid.asked == [2]
    paid.asked.clear()
    batched = dataclasses.replace(_ctx(4), step_rows=7, step_tokens=7.0)
    assert h.propose(batched).tokens == (3,) and paid.asked == []
    # a step whose fixed cost dwarfs a row and a propose: the node pays again (tokens are dear)
    dear = dataclasses.replace(batched, step_fixed=1000.0)
    assert h.propose(dear).tokens == (3, 100, 101) and paid.asked == [3]
    assert paid_nodes([0.5], 1.0, 1, 1.0, 1.0, LatencyCurve(CURVE), fixed=1000.0) == 1


def test_a_member_that_cannot_price_its_nodes_always_drafts() -> None:
    class Unpriced(Paid):
        def node_values(self, max_depth: int) -> None:  # type: ignore[override]
            return None

    un = Unpriced([0.5, 0.1], cost=100.0)
    h = HybridDrafter([un, Valued([7], [0.5])], latency=CURVE)
    assert h.propose(_ctx()).tokens == (3, 100, 101, 7) and un.asked == [64]


def test_suffix_node_values_sum_to_its_score_and_fall_along_paths() -> None:
    store = SuffixStore()
    store.add([5, 6, 7, 8, 9, 10, 11] * 3)
    d = SuffixDrafter(store, use_local=False, latency={1: 1.0, 64: 1.0}, alpha=4.0)  # rows free: long chains
    ctx = DraftContext([1, 5, 6, 7, 8, 9], None, max_nodes=32, max_depth=16)
    tree, values = d.propose_valued(ctx)
    assert len(values) == len(tree) - 1 >= 2
    assert d.propose_scored(ctx)[1] == pytest.approx(sum(values))
    for i, p in enumerate(tree.parents[1:]):
        assert 0.0 < values[i] <= (1.0 if p == 0 else values[p - 1])


def _heads_with_accuracies(m: torch.nn.Module) -> MedusaHeads:
    acc = [[0.4, 0.1, 0.05], [0.3, 0.1, 0.05]]
    cfg = MedusaConfig("tiny", m.hidden_size, m.vocab_size, num_heads=2, extra={"rank_accuracy": acc})
    return MedusaHeads(cfg, m.lm_head.weight)


def test_medusa_node_values_follow_its_tree_order_and_shipped_accuracies() -> None:
    m = tiny_llama()
    d = MedusaDrafter(_heads_with_accuracies(m), ((0,), (0, 0), (1,), (0, 1)))
    assert d.ordered_choices(8) == [(0,), (1,), (0, 0), (0, 1)]
    assert d.node_values(8) == pytest.approx([0.4, 0.1, 0.4 * 0.3, 0.4 * 0.1])
    assert d.node_values(1) == pytest.approx([0.4, 0.1])
    tree = d.propose(DraftContext([1, 2, 7], torch.randn(m.hidden_size), max_nodes=64, max_depth=8))
    assert tree.parents == (-1, 0, 0, 1, 1)  # node i + 1 is ordered_choices()[i]: depth 1 first, then ranks
    plain = MedusaDrafter(MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight))
    assert plain.node_values(8) is None  # no shipped accuracies: not priced


def test_registry_default_prices_the_heads_and_keeps_greedy_output(tmp_path: Path) -> None:
    m = tiny_llama()
    heads = _heads_with_accuracies(m)
    heads.save(tmp_path / "h")
    d = registry.build("hybrid-suffix", m, None, registry.DrafterOptions("tiny", heads=str(tmp_path / "h")))
    assert isinstance(d, HybridDrafter) and d.latency is not None
    medusa = next(x for x in d.drafters if isinstance(x, MedusaDrafter))
    assert medusa.draft_cost > 0.0
    prompt = [1, 5, 9, 5, 9, 5, 9, 3, 5]
    cfg = GenerationConfig(max_new_tokens=24)
    assert Engine(m).generate(prompt, cfg, d).token_ids == Engine(m).generate(prompt, cfg, None).token_ids


def test_heads_draft_cost_is_measured_once_per_machine_and_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    m = tiny_llama()
    medusa = MedusaDrafter(_heads_with_accuracies(m), ((0,), (0, 0), (1,)))
    calls = {"n": 0}
    real = medusa.propose

    def counting(ctx):
        calls["n"] += 1
        return real(ctx)

    object.__setattr__(medusa, "propose", counting)
    lat = {1: 0.01, 2: 0.011}
    first = registry.draft_cost_on_curve(m, medusa, lat, reps=3)
    assert calls["n"] == 4 and first > 0.0  # the warm-up + 3 timed drafts
    again = registry.draft_cost_on_curve(m, medusa, {1: 0.02, 2: 0.022}, reps=3)
    assert calls["n"] == 4  # read from the cache, not measured again
    assert again == pytest.approx(2 * first)  # the cached ratio, scaled by this curve's one-row time
    (entry,) = (tmp_path / "cache" / "tune").glob(f"{registry.MEDUSA_DRAFT_COST_KIND}-*.json")
    entry.write_text("{not json")  # a corrupt entry is measured again, not a crash
    registry.draft_cost_on_curve(m, medusa, lat, reps=3)
    assert calls["n"] == 8
    # a smaller drafting vocabulary streams less per propose: its cost is its own measurement, not the cached one
    medusa.heads.set_base(m.lm_head.weight, torch.arange(m.vocab_size // 2))
    registry.draft_cost_on_curve(m, medusa, lat, reps=3)
    assert calls["n"] == 12
    registry.draft_cost_on_curve(m, medusa, lat, reps=3)
    assert calls["n"] == 12  # and that one is cached in turn

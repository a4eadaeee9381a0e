"""The drafters' native weight copies in q8 or q4, and the per-machine choice between them (drafters/draft_format.py),
on tiny seeded models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_stats import one_thread  # noqa: F401
from test_batch import native_tiny
from test_eagle import random_net

from treedraft import kernels
from treedraft.drafters import registry
from treedraft.drafters.draft_format import EAGLE_FORMATS, MEDUSA_FORMATS, cheapest
from treedraft.drafters.eagle import EagleDrafter, fast_drafting
from treedraft.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.engine import Engine, GenerationConfig

pytestmark = pytest.mark.usefixtures("one_thread")

LATENCY = {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.018, 16: 0.030}


def test_cheapest_takes_the_lowest_cost_and_the_first_on_a_tie() -> None:
    costs = {"q8": 2.0, "q4": 1.0, "x": 3.0}
    assert cheapest(["q8", "q4", "x"], costs.__getitem__) == "q4"
    assert cheapest(["q8", "q4"], lambda f: 1.0) == "q8"
    with pytest.raises(ValueError):
        cheapest([], lambda f: 0.0)
    # a preferred first candidate is kept within the tolerance, not beyond it
    assert cheapest(["q4", "q8"], {"q4": 1.04, "q8": 1.0}.__getitem__, 0.05) == "q4"
    assert cheapest(["q4", "q8"], {"q4": 1.06, "q8": 1.0}.__getitem__, 0.05) == "q8"
    assert MEDUSA_FORMATS[0] == "q8" and EAGLE_FORMATS[0] == "q4"  # see draft_format: quality, and in-situ speed


def _kinds(fast, head) -> tuple[set[str], str]:
    blk = fast.layer
    lins = (blk.attn.wqkv, blk.attn.wo, blk.ffn.w13, blk.ffn.w2, fast.fc)
    return {m.packed.kind_name for m in lins}, head.packed.kind_name


def test_fast_drafting_packs_the_draft_layer_in_the_asked_format_and_keeps_greedy_output() -> None:
    if not kernels.available():
        pytest.skip("no native kernels")
    model = native_tiny(seed=5)
    net = random_net(model, 2, draft_vocab=24, depth=3, topk=3)
    f8, h8, _ = fast_drafting(net, model)
    f4, h4, vm = fast_drafting(net, model, "q4")
    f4h, h4h, _ = fast_drafting(net, model, "q4h")
    assert _kinds(f8, h8) == ({"Q8_0"}, "Q8_0")
    assert _kinds(f4, h4) == ({"Q4_1"}, "Q8_0")  # the head stays q8: in q4 it lost draft quality
    assert _kinds(f4h, h4h) == ({"Q4_1"}, "Q4_1")
    with pytest.raises(ValueError, match="q4h"):
        fast_drafting(net, model, "q5")
    # the q4 layer computes nearly the float net's features (4-bit rounding of its weights only)
    feats = torch.randn(5, model.hidden_size, generator=torch.Generator().manual_seed(0))
    x = torch.tensor([[1, 2, 3, 4, 5]])
    want = net(feats[None], x, torch.arange(5), net.new_cache(8), 0)[0]
    got = f4(feats[None], x, torch.arange(5), f4.new_cache(8), 0)[0]
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.98
    # drafting from the q4 copy: output = plain
    d = EagleDrafter(f4, max_len=256, project=h4, project_vocab=vm)
    prompt, cfg = [3, 9, 27, 17, 5, 9, 27], GenerationConfig(max_new_tokens=24, ignore_eos=True)
    assert Engine(model).generate(prompt, cfg, d).token_ids == Engine(model).generate(prompt, cfg, None).token_ids


def _heads_dir(tmp_path: Path, model) -> Path:
    cfg = MedusaConfig("tiny", model.hidden_size, model.vocab_size, num_heads=4)  # the default tree's depth
    MedusaHeads(cfg, model.lm_head.weight).save(tmp_path / "heads")
    return tmp_path / "heads"


def test_medusa_projection_in_q4_ranks_like_the_float_heads() -> None:
    if not kernels.available():
        pytest.skip("no native kernels")
    model = native_tiny(seed=3)
    cfg = MedusaConfig("tiny", model.hidden_size, model.vocab_size, num_heads=2)
    heads = MedusaHeads(cfg, model.lm_head.weight.detach().clone())
    h = torch.randn(model.hidden_size, generator=torch.Generator().manual_seed(1))
    want = heads.draft_logits(h, None, 2)  # never packed: float32
    assert heads.pack_for_drafting("q8") and heads.draft_path == "native-q8"
    q8 = heads.draft_logits(h, None, 2)
    assert heads.pack_for_drafting("q4") and heads.draft_path == "native-q8-proj-q4"
    q4 = heads.draft_logits(h, None, 2)
    assert not torch.equal(q4, q8)  # another copy of the projection really drafts
    for got in (q8, q4):
        assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.98
    with pytest.raises(ValueError, match="q4"):
        heads.pack_for_drafting("q2")


def test_medusa_for_target_drafts_with_the_cheaper_projection_where_it_has_the_curve(tmp_path, monkeypatch) -> None:
    if not kernels.available():
        pytest.skip("no native kernels")
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    model = native_tiny(seed=3)
    d = _heads_dir(tmp_path, model)
    asked: list[str] = []

    def fake_cost(target, medusa, latency, reps=11):
        asked.append(medusa.heads.draft_path)
        return cost[medusa.heads.draft_path]

    monkeypatch.setattr(registry, "draft_cost_on_curve", fake_cost)
    cost = {"native-q8": 2e-3, "native-q8-proj-q4": 1e-3}
    m = MedusaDrafter.for_target(model, d, "tiny", latency=LATENCY)
    assert m.heads.draft_path == "native-q8-proj-q4" and sorted(asked) == sorted(cost)
    cost = {"native-q8": 1e-3, "native-q8-proj-q4": 2e-3}
    assert MedusaDrafter.for_target(model, d, "tiny", latency=LATENCY).heads.draft_path == "native-q8"
    asked.clear()
    # no curve (the unpaid `medusa` method), or a format asked for: nothing is measured
    assert MedusaDrafter.for_target(model, d, "tiny").heads.draft_path == "native-q8"
    assert MedusaDrafter.for_target(model, d, "tiny", "q4", LATENCY).heads.draft_path == "native-q8-proj-q4"
    assert asked == []


def test_registry_eagle_drafts_with_the_format_whose_full_tree_costs_least(tmp_path, monkeypatch) -> None:
    if not kernels.available():
        pytest.skip("no native kernels")
    from treedraft.drafters import eagle_cost

    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    model = native_tiny(seed=5)
    random_net(model, 2, draft_vocab=24, depth=3, topk=3).save(tmp_path / "eagle")
    costs = {}  # format -> (depth-1 propose, each further depth), ratios to the one-row forward

    def fake(target, eagle, one_row_seconds, reps=11):
        return tuple(c * one_row_seconds for c in costs[eagle.draft_weights])

    monkeypatch.setattr(eagle_cost, "eagle_draft_costs_on_curve", fake)
    opts = registry.DrafterOptions("tiny", heads=str(tmp_path / "eagle"))
    costs.update(q8=(0.2, 0.2), q4=(0.25, 0.1))  # q4: dearer first depth, cheaper further ones (depth 3: 0.45 < 0.6)
    e = registry.build("eagle", model, None, opts)
    if e.curve is None:
        pytest.skip("the tiny target has no measured curve here")
    assert e.draft_weights == "q4" and e.draft_costs[0] == pytest.approx(0.25 * float(e.curve(1)))
    costs.update(q8=(0.2, 0.1), q4=(0.25, 0.1))  # q8 11% cheaper (0.40 vs 0.45 at depth 3): beyond the 5% that keeps q4
    assert registry.build("eagle", model, None, opts).draft_weights == "q8"
    costs.update(q8=(0.2, 0.1), q4=(0.21, 0.1))  # within 5%: the preferred q4
    assert registry.build("eagle", model, None, opts).draft_weights == "q4"


@pytest.mark.slow
@pytest.mark.usefixtures("warm_cache")  # int4 kernels from the session's weights=auto measurement
def test_shipped_heads_with_the_q4_projection_keep_greedy_output_on_the_real_model() -> None:
    from conftest import load_real

    from treedraft.drafters.medusa import shipped_heads_for

    d = shipped_heads_for("smollm2-135m-instruct")
    if d is None or not kernels.available():
        pytest.skip("no shipped heads or no native kernels")
    llm = load_real(drafter=None, weights="int4")
    m = MedusaDrafter.for_target(llm.model, d, "smollm2-135m-instruct", proj_format="q4")
    assert m.heads.draft_path == "native-q8-proj-q4"
    for q in ("Write a short poem about the sea.", "Explain what a hash table is."):
        plain = llm.generate(q, drafter=None, max_new_tokens=64)
        spec = llm.generate(q, drafter=m, max_new_tokens=64)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.mean_accepted_length > 1.05  # the heads' drafts are accepted

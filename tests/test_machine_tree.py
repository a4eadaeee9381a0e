"""The Medusa tree is chosen per machine at first use (shipped accuracies + measured latency) and cached."""

from __future__ import annotations

import json

import pytest

from treedraft.budget import CHECK_SIZES
from treedraft.drafters.medusa import DEFAULT_CHOICES, HEADS_DIR, MedusaConfig, MedusaDrafter, MedusaHeads
from treedraft.drafters.registry import DrafterOptions, build
from treedraft.models.tiny import tiny_llama
from treedraft.training import calibrate

ACC = [[0.7, 0.2, 0.05], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
# flat up to 8 tokens, then steep: the best tree fills 7 draft nodes, not the whole budget
LATENCY = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.010, 12: 0.030, 16: 0.040, 24: 0.060, 32: 0.080, 48: 0.120, 64: 0.160}


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    """Tiny target, heads with accuracies and no tree, a private cache, counted latency measurements."""
    from treedraft.models.quant import native_kernels

    native_kernels()  # built/loaded under the real cache: a private one would rebuild it and print a line
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TREEDRAFT_RETUNE", raising=False)
    monkeypatch.setenv("TREEDRAFT_CURVE_CHECK", "1")
    m = tiny_llama()
    cfg = MedusaConfig("tiny", m.hidden_size, m.vocab_size, num_heads=3, extra={"rank_accuracy": ACC})
    heads_dir = tmp_path / "heads"
    MedusaHeads(cfg, m.lm_head.weight).save(heads_dir)
    calls = []  # full measurements (a cached tree's check of its curve, budget.CHECK_SIZES, is not counted here)

    def fake_latency(model, context, sizes, reps=5):
        if tuple(sizes) != CHECK_SIZES:
            calls.append((context, tuple(sizes)))
        return {n: LATENCY[n] for n in sizes}

    monkeypatch.setattr(calibrate, "measure_latency", fake_latency)
    monkeypatch.setattr(calibrate, "measure_draft_cost", lambda heads, reps=10: 0.0)
    return m, heads_dir, calls


def _build(m, heads_dir) -> MedusaDrafter:
    return build("medusa", m, None, DrafterOptions("tiny", str(heads_dir)))  # a fresh drafter each time


def test_tree_is_measured_once_per_machine_and_then_read_from_the_cache(setup, capsys, tmp_path) -> None:
    m, heads_dir, calls = setup
    d = _build(m, heads_dir)
    assert len(calls) == 1 and calls[0][1][-1] == calibrate.TREE_MAX_NODES
    want = calibrate.choose_tree(ACC, LATENCY, 0.0, calibrate.TREE_MAX_NODES, min_nodes=1)["choices"]
    assert len(want) == 7 and d.choices == tuple(tuple(c) for c in want)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measuring this machine's latency" in err and "7 draft nodes" in err
    d2 = _build(m, heads_dir)
    hybrid = build("hybrid", m, None, DrafterOptions("tiny", str(heads_dir)))
    assert len(calls) == 1 and d2.choices == d.choices == hybrid.drafters[0].choices  # no measurement
    assert capsys.readouterr().err == ""
    (f,) = (tmp_path / "cache" / "tune").glob("medusa-tree-*.json")
    assert json.loads(f.read_text())["value"]["choices"] == want
    assert not (heads_dir / "medusa.json").read_text().count("choices")  # nothing written next to the heads


def test_retune_corrupt_cache_and_other_heads_measure_again(setup, monkeypatch, tmp_path) -> None:
    m, heads_dir, calls = setup
    _build(m, heads_dir)
    (f,) = (tmp_path / "cache" / "tune").glob("medusa-tree-*.json")
    f.write_text('{"key": {}, "value": ')
    _build(m, heads_dir)
    assert len(calls) == 2
    d = json.loads(f.read_text())
    d["value"]["choices"] = [[0, 0, 0, 0, 0]]  # deeper than the 3 heads: unusable, measured again
    f.write_text(json.dumps(d))
    _build(m, heads_dir)
    assert len(calls) == 3
    monkeypatch.setenv("TREEDRAFT_RETUNE", "1")
    _build(m, heads_dir)
    assert len(calls) == 4
    monkeypatch.delenv("TREEDRAFT_RETUNE")
    (heads_dir / "medusa.json").touch()  # other heads file (new mtime): another cache entry
    import os

    st = (heads_dir / "medusa.json").stat()
    os.utime(heads_dir / "medusa.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _build(m, heads_dir)
    assert len(calls) == 5


def test_a_tree_chosen_on_a_curve_this_machine_no_longer_shows_is_chosen_again(setup, capsys, tmp_path) -> None:
    """A tree is chosen from the latency curve measured with it; when a check of a few forwards timed now gives a
    curve of another shape (a tree measured beside a test run or in a slow phase of a shared host: 1 draft node
    where 3-4 pay), the tree is chosen again, once; a curve that matches keeps it."""
    m, heads_dir, calls = setup
    _build(m, heads_dir)
    (f,) = (tmp_path / "cache" / "tune").glob("medusa-tree-*.json")
    d = json.loads(f.read_text())
    steep = {1: 6.0, 2: 8.6, 4: 12.1, 8: 17.2, 12: 21.5, 16: 27.3, 24: 41.2, 32: 52.6, 48: 74.1, 64: 97.7}
    d["value"]["latency_ms"] = {str(k): v for k, v in steep.items()}
    d["value"]["choices"] = [[0]]
    f.write_text(json.dumps(d))
    capsys.readouterr()
    again = _build(m, heads_dir)
    assert len(calls) == 2 and len(again.choices) == 7
    assert "chosen on a latency curve" in capsys.readouterr().err
    assert _build(m, heads_dir).choices == again.choices and len(calls) == 2  # its own curve matches: kept


def test_a_tree_is_kept_when_other_processes_are_busy_during_the_check(setup, monkeypatch, tmp_path) -> None:
    """Under other processes' load a new measurement would be no better than the cached one: keep it."""
    from treedraft.models import plan

    m, heads_dir, calls = setup
    _build(m, heads_dir)
    (f,) = (tmp_path / "cache" / "tune").glob("medusa-tree-*.json")
    d = json.loads(f.read_text())
    d["value"]["latency_ms"] = {"1": 6.0, "2": 8.6, "4": 12.1, "8": 17.2, "64": 97.7}
    d["value"]["choices"] = [[0]]
    f.write_text(json.dumps(d))
    monkeypatch.setattr(plan.CpuWindow, "others", lambda self: 1.0)
    assert _build(m, heads_dir).choices == ((0,),) and len(calls) == 1


def test_stored_tree_is_used_without_measuring(setup) -> None:
    """What `treedraft calibrate --write` stores is what the next drafter uses."""
    m, heads_dir, calls = setup
    res = calibrate.choose_tree(ACC, {1: 0.01, 64: 0.01}, 0.0, 5)
    heads = MedusaHeads.load(heads_dir, m.lm_head.weight)
    heads.pack_for_drafting()
    rec = calibrate.tree_record(res, {1: 0.01, 64: 0.01}, 5, 16)
    calibrate.store_machine_tree(m, heads_dir, "tiny", rec, heads.draft_path)
    d = _build(m, heads_dir)
    assert calls == [] and d.choices == tuple(tuple(c) for c in res["choices"]) and len(d.choices) == 4


def test_heads_with_a_fixed_tree_or_without_accuracies_measure_nothing(setup, tmp_path) -> None:
    m, _, calls = setup
    fixed = tmp_path / "fixed"
    MedusaHeads(
        MedusaConfig(
            "tiny", m.hidden_size, m.vocab_size, num_heads=3, choices=((0,), (0, 0)), extra={"rank_accuracy": ACC}
        ),
        m.lm_head.weight,
    ).save(fixed)
    assert _build(m, fixed).choices == ((0,), (0, 0))
    bare = tmp_path / "bare"
    MedusaHeads(MedusaConfig("tiny", m.hidden_size, m.vocab_size), m.lm_head.weight).save(bare)
    assert "choices" not in json.loads((bare / "medusa.json").read_text())
    assert _build(m, bare).choices == DEFAULT_CHOICES
    assert calls == []


def test_bad_accuracies_are_refused_with_a_clear_error(setup, tmp_path) -> None:
    m, _, _ = setup
    bad = tmp_path / "bad"
    MedusaHeads(
        MedusaConfig("tiny", m.hidden_size, m.vocab_size, num_heads=3, extra={"rank_accuracy": ACC[:2]}),
        m.lm_head.weight,
    ).save(bad)
    with pytest.raises(ValueError, match="rank_accuracy must be 3 lists"):
        _build(m, bad)


def test_shipped_heads_carry_accuracies_not_a_tree() -> None:
    raw = json.loads((HEADS_DIR / "smollm2-135m-instruct" / "medusa.json").read_text())
    assert "choices" not in raw and "calibration" not in raw["extra"]
    assert "latency" not in json.dumps(raw)  # nothing measured on one machine
    cfg = MedusaConfig.from_json(raw)
    acc = calibrate.shipped_accuracies(cfg)
    assert cfg.choices == () and len(acc) == cfg.num_heads and all(len(row) == 10 for row in acc)
    # rank-0 accuracy is the heads' MT-Bench top-1 accuracy recorded at training time
    assert [row[0] for row in acc] == pytest.approx(raw["extra"]["training"]["mt_bench"]["top1"])


def test_tree_cache_is_keyed_by_the_linear_kernels(setup) -> None:
    """A model whose linears were swapped (int4/int8/native kernels) has another latency curve: another tree."""
    import torch

    m, heads_dir, _ = setup
    before = calibrate.tree_key(m, heads_dir, "tiny")

    class Int4PackLinear(torch.nn.Linear):  # stands in for a swapped-in quantized module
        pass

    m.layers[0].ffn.w2 = Int4PackLinear(m.layers[0].ffn.w2.in_features, m.layers[0].ffn.w2.out_features, bias=False)
    after = calibrate.tree_key(m, heads_dir, "tiny")
    assert before != after and "Int4PackLinear" in after["linears"]


def test_tree_cache_is_keyed_by_the_draft_path(setup) -> None:
    """Native int8 drafting costs ~30x less than emulated bf16: a tree stored for one must not serve the other."""
    m, heads_dir, calls = setup
    res = calibrate.choose_tree(ACC, {1: 0.01, 64: 0.01}, 0.0, 5)
    rec = calibrate.tree_record(res, {1: 0.01, 64: 0.01}, 5, 16)
    path = _build(m, heads_dir).heads.draft_path  # measures once (cold cache)
    assert path in ("native-q8", "bf16", "float32") and len(calls) == 1
    other = "bf16" if path != "bf16" else "native-q8"
    calibrate.store_machine_tree(m, heads_dir, "tiny", rec, other)
    calls.clear()
    for f in (heads_dir.parent / "cache" / "tune").glob("medusa-tree-*.json"):
        if f'"{path}"' in f.read_text():
            f.unlink()  # forget the measured entry: only the other path's tree is stored now
    assert _build(m, heads_dir).choices != tuple(tuple(c) for c in res["choices"]) and len(calls) == 1
    calibrate.store_machine_tree(m, heads_dir, "tiny", rec, path)
    assert _build(m, heads_dir).choices == tuple(tuple(c) for c in res["choices"]) and len(calls) == 1


def test_measurement_keys_follow_the_native_kernel_sources(setup, monkeypatch) -> None:
    """A latency curve (or tree, or draft cost) measured with older native kernels is not reused after they change."""
    import torch

    from treedraft.kernels import _build

    m, heads_dir, _ = setup
    monkeypatch.setattr(calibrate, "_fused_decode", lambda target: False)
    assert calibrate._target_facts(m)["kernels"] is None  # pure PyTorch linears, unfused: no native build in the key
    monkeypatch.setattr(_build, "build_key", lambda: "kernels-v0")
    monkeypatch.setattr(calibrate, "_fused_decode", lambda target: True)  # fp32 Linears inside the fused step (f32mm)
    assert calibrate._target_facts(m)["kernels"] == "kernels-v0"
    monkeypatch.setattr(calibrate, "_fused_decode", lambda target: False)

    class NativeLinear(torch.nn.Linear):  # stands in for a linear running the native kernels
        pass

    m.layers[0].ffn.w2 = NativeLinear(m.layers[0].ffn.w2.in_features, m.layers[0].ffn.w2.out_features, bias=False)
    monkeypatch.setattr(_build, "build_key", lambda: "kernels-v1")
    before = calibrate.tree_key(m, heads_dir, "tiny")
    monkeypatch.setattr(_build, "build_key", lambda: "kernels-v2")
    after = calibrate.tree_key(m, heads_dir, "tiny")
    assert before["kernels"] == "kernels-v1" and after["kernels"] == "kernels-v2"


def test_latency_curve_keeps_each_sizes_fastest_interleaved_rep(monkeypatch) -> None:
    """Load from other processes only ever adds time: a burst during one rep of a size must not become that size's
    cost (the median of consecutive reps did: a curve measured beside a test run read 1 row slower than 8)."""
    import torch

    clock = {"t": 0.0}
    order: list[int] = []

    class Fake:
        vocab_size, device = 11, "cpu"

        def new_cache(self, n):
            return type("C", (), {"keep": lambda self, *a: None})()

        def forward(self, toks, pos, cache, start, mask=None, logits_for=None):
            n = toks.shape[-1]
            if start > 0:
                order.append(n)
            # 1 ms per row; the first and last of the three timed forwards of 4 rows meet a burst of load (a median,
            # or the last rep, keeps one)
            burst = 0.05 if n == 4 and order.count(4) in (2, 4) else 0.0
            clock["t"] += 0.001 * n + burst
            return torch.zeros(1), None

    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock["t"])
    lat = calibrate.measure_latency(Fake(), context=8, sizes=(1, 4, 8), reps=3)
    assert lat == pytest.approx({1: 0.001, 4: 0.004, 8: 0.008})
    assert order[:6] == [1, 4, 8, 1, 4, 8]  # rounds interleave the sizes (a warm-up round first)
    assert len(order) == 3 * 4

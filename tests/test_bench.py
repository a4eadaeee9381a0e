"""The benchmark harness on a tiny seeded model: records, arithmetic, mismatches, report files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from treedraft import bench
from treedraft.api import LLM
from treedraft.bench import (
    ALL_CATEGORIES,
    BenchError,
    BenchPrompt,
    EngineMethod,
    MethodOutput,
    Record,
    load_prompts,
    report,
    run_bench,
    select_prompts,
    summarize,
    write_report,
)
from treedraft.drafters.prompt_lookup import PromptLookupDrafter
from treedraft.engine import Engine, GenerationConfig
from treedraft.models.tiny import tiny_llama
from treedraft.sampling import SamplingParams
from treedraft.text import TextGenerator

MAX_NEW = 12


def fake_encode(text: str, vocab: int = 64) -> list[int]:
    """A stand-in tokenizer: one id per byte, folded into the tiny vocabulary."""
    return [b % vocab for b in text.encode()]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls are ~30x slower with several threads on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine() -> TextGenerator:
    return TextGenerator(Engine(tiny_llama(seed=1, scale=2.0)))  # no tokenizer, no EOS


def tiny_llm(engine: TextGenerator) -> LLM:
    """An LLM over the tiny engine: prompts are fake-encoded, the text layer yields token ids only."""

    class TinyLLM(LLM):
        def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
            return fake_encode(prompt)

    tok = SimpleNamespace(
        decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)), eos_token_ids=frozenset()
    )
    llm = TinyLLM(engine.engine, tok, "tiny", "cpu")
    llm.text = engine  # this stub tokenizer cannot stream text
    return llm


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["abcabcabcabc abcabc", "second turn ignored"]},
        {"prompt": "xyz xyz xyz xyzxyz", "category": "math"},
    ]
    p = tmp_path_factory.mktemp("data") / "q.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def wrong_after(method, position: int = 3):
    """A deliberately wrong method: a correct one with one output token changed."""

    def run(ids: list[int]) -> MethodOutput:
        out = method(ids)
        toks = list(out.token_ids)
        toks[position] = (toks[position] + 1) % 64
        return MethodOutput(toks, out.stats, out.finish_reason)

    return run


def truncate(method, n: int = 5):
    """A deliberately wrong method: a correct prefix cut off without EOS, no stats, returned as a tuple."""

    def run(ids: list[int]) -> tuple[list[int], None]:
        return method(ids).token_ids[:n], None

    return run


class StopsAtEOS:
    """Like the transformers baseline: the correct tokens up to and including the first of its EOS ids
    (which the tiny engine, having none, runs past); no stats, returned as a tuple."""

    def __init__(self, method, eos: set[int]) -> None:
        self.method, self.eos_token_ids = method, frozenset(eos)

    def __call__(self, ids: list[int]) -> tuple[list[int], None]:
        toks = self.method(ids).token_ids
        return toks[: first_eos_cut(toks, self.eos_token_ids)], None


def first_eos_cut(toks: list[int], eos: frozenset[int]) -> int:
    return next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))


@pytest.fixture(scope="module")
def eos_id(engine: TextGenerator, dataset: Path) -> int:
    """An id the plain output of prompt 1 holds at index 3: an EOS for the HF-like method."""
    ids = fake_encode(load_prompts(dataset)[0].text)
    return engine.generate(ids, GenerationConfig(max_new_tokens=MAX_NEW), None).token_ids[3]


@pytest.fixture(scope="module")
def result(engine: TextGenerator, dataset: Path, eos_id: int) -> bench.BenchResult:
    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    cfg = GenerationConfig(max_new_tokens=MAX_NEW)
    plain = EngineMethod(engine, cfg, None)
    methods = {
        "hf": StopsAtEOS(plain, {eos_id}),
        "plain": plain,
        "prompt-lookup": EngineMethod(engine, cfg, PromptLookupDrafter()),
        "wrong": wrong_after(plain),
        "truncated": truncate(plain, 5),
    }
    return run_bench(prompts, methods, warmup=1, baselines=("hf", "plain"), progress=False)


def test_load_prompts_reads_both_formats_first_turn(dataset: Path) -> None:
    ps = load_prompts(dataset)
    assert [(p.id, p.category, p.text) for p in ps] == [
        ("1", "writing", "abcabcabcabc abcabc"),
        ("2", "math", "xyz xyz xyz xyzxyz"),
    ]


def test_load_prompts_rejects_bad_lines(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "x"}\n')
    with pytest.raises(BenchError, match="bad.jsonl:1"):
        load_prompts(bad)
    with pytest.raises(BenchError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_select_prompts_round_robin_over_categories() -> None:
    ps = [BenchPrompt(str(i), c, "t") for i, c in enumerate("aaabbc")]
    assert [p.id for p in select_prompts(ps, 4)] == ["0", "3", "5", "1"]
    assert select_prompts(ps, None) == ps


def test_records_are_complete(result: bench.BenchResult, eos_id: int) -> None:
    assert result.methods == ["hf", "plain", "prompt-lookup", "wrong", "truncated"]
    assert result.skipped == {}
    assert sorted((r.method, r.prompt_id) for r in result.records) == sorted(
        (m, q) for m in result.methods for q in ("1", "2")
    )
    for r in result.records:
        assert r.new_tokens == len(r.token_ids) > 0
        assert r.wall_s > 0 and r.tokens_per_s == pytest.approx(r.new_tokens / r.wall_s)
        assert r.category == {"1": "writing", "2": "math"}[r.prompt_id]
        assert r.prompt_tokens == len(fake_encode({"1": "abcabcabcabc abcabc", "2": "xyz xyz xyz xyzxyz"}[r.prompt_id]))
        if r.method in ("hf", "truncated"):
            assert r.accepted_lengths is None and r.t_verify is None
            plain_ids = next(p.token_ids for p in result.records if p.method == "plain" and p.prompt_id == r.prompt_id)
            cut = first_eos_cut(plain_ids, frozenset({eos_id})) if r.method == "hf" else 5
            assert r.new_tokens == cut and r.token_ids == plain_ids[:cut]
        else:
            assert r.new_tokens == MAX_NEW
            # every committed token after the prefill's first one comes from a verify step
            assert 1 + sum(r.accepted_lengths) == r.new_tokens
            assert len(r.tree_depths) == len(r.accepted_lengths) == len(r.tree_sizes)
            assert r.t_prefill is not None and r.t_draft + r.t_verify + r.t_rest <= r.wall_s
    plain = [r for r in result.records if r.method == "plain"]
    assert all(set(r.accepted_lengths) == {1} and set(r.tree_depths) == {0} for r in plain)


def test_speedups_are_computed_from_the_records(result: bench.BenchResult) -> None:
    s = summarize(result)

    def tps(method: str, cat: str) -> float:
        rs = [r for r in result.records if r.method == method and cat in ("all", r.category)]
        return sum(r.new_tokens for r in rs) / sum(r.wall_s for r in rs)

    assert set(s) == {"all", "writing", "math"}
    for cat in s:
        for m in result.methods:
            assert s[cat][m]["tokens_per_s"] == pytest.approx(tps(m, cat))
            for b in ("hf", "plain"):
                assert s[cat][m]["speedup"][b] == pytest.approx(tps(m, cat) / tps(b, cat))
        assert s[cat]["plain"]["speedup"]["plain"] == pytest.approx(1.0)
    pl = [r for r in result.records if r.method == "prompt-lookup"]
    acc = [a for r in pl for a in r.accepted_lengths]
    assert s["all"]["prompt-lookup"]["mean_accepted_length"] == pytest.approx(sum(acc) / len(acc))
    assert s["all"]["prompt-lookup"]["steps"] == len(acc)
    assert s["all"]["plain"]["mean_accepted_length"] == 1.0
    assert s["all"]["hf"]["mean_accepted_length"] is None and s["all"]["hf"]["time_split"] is None
    steps = [(d, a - 1) for r in pl for d, a in zip(r.tree_depths, r.accepted_lengths)]
    want = [
        sum(a >= d for dd, a in steps if dd >= d) / sum(dd >= d for dd, _ in steps)
        for d in range(1, max(dd for dd, _ in steps) + 1)
    ]
    assert s["all"]["prompt-lookup"]["acceptance_per_depth"] == pytest.approx(want)
    split = s["all"]["prompt-lookup"]["time_split"]
    wall = sum(r.wall_s for r in pl)
    assert split["draft"] == pytest.approx(sum(r.t_draft for r in pl) / wall)
    assert split["draft"] + split["verify"] + split["rest"] == pytest.approx(1.0)


def test_wrong_and_truncating_methods_are_detected_as_mismatches(result: bench.BenchResult) -> None:
    by = {(r.method, r.prompt_id): r for r in result.records}
    assert by[("hf", "1")].new_tokens < MAX_NEW  # the HF-like method did stop early on prompt 1
    for q in ("1", "2"):
        assert by[("plain", q)].equal_to_reference is True
        assert by[("prompt-lookup", q)].equal_to_reference is True  # greedy speculative = plain
        # shorter, but it ended at its own EOS where plain (no EOS) has the same token and runs on
        assert by[("hf", q)].equal_to_reference is True and by[("hf", q)].mismatch is None
        assert (by[("wrong", q)].equal_to_reference, by[("wrong", q)].first_mismatch, by[("wrong", q)].mismatch) == (
            False,
            3,
            "differs",
        )
        # a correct prefix cut off without EOS is not hidden by the shorter length
        assert (
            by[("truncated", q)].equal_to_reference,
            by[("truncated", q)].first_mismatch,
            by[("truncated", q)].mismatch,
        ) == (False, 5, "truncated")
    mism = bench.mismatches(result)
    assert sorted((m["method"], m["prompt_id"], m["position"], m["kind"]) for m in mism) == [
        ("truncated", "1", 5, "truncated"),
        ("truncated", "2", 5, "truncated"),
        ("wrong", "1", 3, "differs"),
        ("wrong", "2", 3, "differs"),
    ]
    t = next(m for m in mism if m["method"] == "truncated")
    assert (t["reference_length"], t["method_length"]) == (MAX_NEW, 5) and len(t["method_tokens"]) < len(
        t["reference_tokens"]
    )
    s = summarize(result)["all"]
    assert (s["wrong"]["equal"], s["wrong"]["compared"]) == (0, 2)
    assert (s["truncated"]["equal"], s["truncated"]["compared"]) == (0, 2)
    assert (s["hf"]["equal"], s["hf"]["compared"]) == (2, 2)
    assert (s["prompt-lookup"]["equal"], s["prompt-lookup"]["compared"]) == (2, 2)


def test_compare_outputs_length_rules() -> None:
    cmp = bench.compare_outputs
    assert cmp([1, 2, 3], [1, 2, 3]) == (True, None, None)
    assert cmp([1, 2, 3], [1, 9, 3]) == (False, 1, "differs")
    assert cmp([1, 2, 3], [1, 9]) == (False, 1, "differs")
    # shorter without EOS: truncated, whatever the reference's EOS ids are
    assert cmp([1, 2, 3], [1, 2]) == (False, 2, "truncated")
    assert cmp([1, 2, 3], [1, 2], reference_eos={2}) == (False, 2, "truncated")
    assert cmp([1, 2, 3], []) == (False, 0, "truncated")
    # the method stopped at its own EOS, where the reference has it and runs on
    assert cmp([1, 2, 3], [1, 2], other_eos={2}) == (True, None, None)
    # the reference stopped at its EOS and the method ran past it; without EOS that is "longer"
    assert cmp([1, 2], [1, 2, 3], reference_eos={2}) == (True, None, None)
    assert cmp([1, 2], [1, 2, 3], other_eos={2}) == (False, 2, "longer")
    # both stopped at the same EOS (the HF case: EOS is kept as the last token by both)
    assert cmp([1, 2, 7], [1, 2, 7], reference_eos={7}, other_eos={7}) == (True, None, None)


def test_methods_declare_the_eos_ids_they_stop_at(engine: TextGenerator) -> None:

    eng = TextGenerator(engine.engine, eos_token_ids=[5, 6])
    assert EngineMethod(eng, GenerationConfig(max_new_tokens=2)).eos_token_ids == {5, 6}
    assert EngineMethod(eng, GenerationConfig(max_new_tokens=2, ignore_eos=True)).eos_token_ids == frozenset()
    hf = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 3]), config=SimpleNamespace(eos_token_id=9))
    assert bench.HFMethod(hf, 4).eos_token_ids == {2, 3}
    hf.generation_config.eos_token_id = None
    assert bench.HFMethod(hf, 4).eos_token_ids == {9}
    assert bench.LlamaCppMethod(SimpleNamespace(token_eos=lambda: 4), 4).eos_token_ids == {4}


def test_baselines_sample_with_the_benchs_min_p() -> None:
    """transformers and llama.cpp draw from the distribution the bench's own methods draw from: --min-p reaches
    both, and llama.cpp is told min_p 0 when none is given (llama-cpp-python's own default is 0.05)."""
    import torch

    seen: dict = {}

    def generate(tokens, **kw):
        seen.update(kw)
        yield 4

    llama = SimpleNamespace(token_eos=lambda: 4, set_seed=lambda s: None, generate=generate)
    bench.LlamaCppMethod(llama, 4, 0.7, 0.9, 0, 1, min_p=0.1)([1, 2])
    assert seen["min_p"] == 0.1 and seen["temp"] == 0.7
    bench.LlamaCppMethod(llama, 4, 0.7, 0.9, 0, 1)([1, 2])
    assert seen["min_p"] == 0.0
    hf_kw: dict = {}

    def hf_generate(x, **kw):
        hf_kw.update(kw)
        return torch.cat([x, torch.tensor([[4]])], 1)

    hf = SimpleNamespace(device="cpu", generate=hf_generate)
    bench.HFMethod(hf, 4, None, 0.7, 0.9, 0, 1, min_p=0.2)([1, 2])
    assert hf_kw["min_p"] == 0.2 and hf_kw["do_sample"]
    hf_kw.clear()
    bench.HFMethod(hf, 4, None, 0.7, 0.9, 0, 1)([1, 2])
    assert "min_p" not in hf_kw


def test_report_files_are_written(result: bench.BenchResult, tmp_path: Path) -> None:
    paths = write_report(result, tmp_path / "out", decode=lambda ids: " ".join(map(str, ids)))
    md = paths["markdown"].read_text()
    for m in result.methods:
        assert f"| `{m}` |" in md
    assert "## Output mismatches" in md and "| `wrong` | 1 | writing | 3 | differs |" in md
    assert f"| `truncated` | 1 | writing | 5 | truncated | {MAX_NEW} / 5 |" in md
    assert "## Speedup vs `hf` per category" in md
    for key in ("speedup_png", "hist_png", "depth_png"):
        data = paths[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    doc = json.loads(paths["json"].read_text())
    # the depth plot draws every method that drafted (its pooled per-depth acceptance) and leaves plain out
    lines = report.plot_acceptance_per_depth(doc["summary"], tmp_path / "d.png", max_depth=3)
    drafted = {m for m, s in doc["summary"][ALL_CATEGORIES].items() if s["acceptance_per_depth"]}
    assert drafted and "plain" not in drafted and set(lines) == drafted
    assert all(v == doc["summary"][ALL_CATEGORIES][m]["acceptance_per_depth"][:3] for m, v in lines.items())
    assert len(doc["records"]) == len(result.records) == 10
    assert doc["reference"] == "plain" and doc["baselines"] == ["hf", "plain"]
    rec = doc["records"][0]
    assert set(rec) >= {
        "method",
        "prompt_id",
        "category",
        "new_tokens",
        "wall_s",
        "token_ids",
        "accepted_lengths",
        "equal_to_reference",
        "mismatch",
        "mean_accepted_length",
    }
    assert doc["summary"]["all"]["wrong"]["equal"] == 0
    assert (
        sorted((m["method"], m["kind"]) for m in doc["mismatches"])
        == [("truncated", "truncated")] * 2 + [("wrong", "differs")] * 2
    )


def test_failing_method_is_dropped_and_reported(engine: TextGenerator, dataset: Path) -> None:
    calls = {"n": 0}

    def flaky(ids: list[int]) -> MethodOutput:
        calls["n"] += 1
        if calls["n"] > 1:  # survives the warm-up, fails on the first timed prompt
            raise RuntimeError("boom")
        return MethodOutput([1, 2, 3])

    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    plain = EngineMethod(engine, GenerationConfig(max_new_tokens=4), None)
    res = run_bench(prompts, {"plain": plain, "flaky": flaky}, progress=False, skipped={"medusa": "no heads"})
    assert res.methods == ["plain"]
    assert "boom" in res.skipped["flaky"] and res.skipped["medusa"] == "no heads"
    assert {r.method for r in res.records} == {"plain"} and len(res.records) == 2


def test_sampling_runs_skip_the_equality_check(engine: TextGenerator, dataset: Path) -> None:
    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    plain = EngineMethod(engine, GenerationConfig(max_new_tokens=4), None)
    res = run_bench(prompts, {"plain": plain, "wrong": wrong_after(plain, 1)}, greedy=False, warmup=0, progress=False)
    assert all(r.equal_to_reference is None for r in res.records)
    assert bench.mismatches(res) == []


class WrongEngine(EngineMethod):
    """One of treedraft's own methods whose output is deliberately wrong at index 2."""

    def __call__(self, prompt_ids: list[int]) -> MethodOutput:
        out = super().__call__(prompt_ids)
        toks = list(out.token_ids)
        toks[2] = (toks[2] + 1) % 64
        return MethodOutput(toks, out.stats, out.finish_reason)


def test_seeded_sampling_runs_check_that_speculative_outputs_equal_plain(
    engine: TextGenerator, dataset: Path, tmp_path: Path
) -> None:
    """A seeded request's tokens are coupled draws keyed by (seed, position): the drafter cannot change them."""
    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=1.5, top_p=0.9, seed=3))
    plain = EngineMethod(engine, cfg, None)
    methods = {"plain": plain, "prompt-lookup": EngineMethod(engine, cfg, PromptLookupDrafter())}
    methods["wrong"] = WrongEngine(engine, cfg, PromptLookupDrafter())
    methods["external"] = plain.__call__  # like the hf / llama.cpp baselines: its own sampler, never compared
    res = run_bench(prompts, methods, greedy=False, seeded=True, warmup=0, progress=False)
    by = {(r.method, r.prompt_id): r for r in res.records}
    for q in {r.prompt_id for r in res.records}:
        assert by[("prompt-lookup", q)].equal_to_reference is True
        assert by[("wrong", q)].equal_to_reference is False
        assert by[("external", q)].equal_to_reference is None
    assert max(by[("prompt-lookup", q)].mean_accepted_length for q in {r.prompt_id for r in res.records}) > 1.0
    assert len(bench.mismatches(res)) == len(prompts)
    text = write_report(res, tmp_path)["markdown"].read_text()
    assert "not checked" not in text and "| `wrong` |" in text


def test_method_names_and_unavailable_methods_are_skipped_with_reason(engine: TextGenerator) -> None:
    assert bench.parse_methods("plain,none,prompt-lookup") == ["plain", "prompt-lookup"]
    with pytest.raises(BenchError, match="unknown method.*typo"):
        bench.parse_methods("plain,typo")
    names = bench.parse_methods("all")
    assert {"hf", "hf-pld", "plain", "prompt-lookup", "medusa"} <= set(names)

    cfg = GenerationConfig(max_new_tokens=4)
    llm = LLM(engine.engine, None, "tiny", "cpu")
    methods, skipped = bench.build_methods(
        ["plain", "prompt-lookup", "medusa", "llama.cpp"], llm, Path("/nonexistent.gguf"), cfg
    )
    assert set(methods) >= {"plain", "prompt-lookup"}
    assert set(methods) | set(skipped) == {"plain", "prompt-lookup", "medusa", "llama.cpp"}
    # the tiny model ships no heads: medusa is skipped with the loader's reason, not a generic one
    assert skipped["medusa"].startswith("FileNotFoundError: no Medusa heads are shipped for 'tiny'")
    if importlib.util.find_spec("llama_cpp") is None:
        assert skipped["llama.cpp"].startswith("BenchError: llama-cpp-python is not installed")
    assert methods["plain"].drafter is None and methods["plain"].config is cfg
    assert isinstance(methods["prompt-lookup"].drafter, PromptLookupDrafter)
    ids = fake_encode("abab abab abab")
    want = engine.generate(ids, cfg, None).token_ids
    plain, pl = methods["plain"](ids), methods["prompt-lookup"](ids)
    assert plain.token_ids == pl.token_ids == want and pl.finish_reason == "length"
    assert pl.stats.new_tokens == 4 and 1 + sum(s.accepted + 1 for s in pl.stats.steps) == 4


def test_bench_cli_end_to_end_on_the_tiny_model(
    engine: TextGenerator, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`treedraft bench` through the real parser and cmd_bench (model loading stubbed with the tiny engine):
    the report matches the run, and the recorded command reproduces the same arguments."""
    import shlex

    import treedraft
    from treedraft.cli import build_parser
    from treedraft.models import registry

    llm = tiny_llm(engine)
    monkeypatch.setattr(treedraft, "load", lambda *a, **k: llm)
    monkeypatch.setattr(registry, "resolve", lambda model: Path("/nonexistent.gguf"))
    out = tmp_path / "out"
    argv = [
        "bench",
        "--dataset",
        str(dataset),
        "--methods",
        "plain,prompt-lookup",
        "--max-new-tokens",
        "6",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--no-progress",
        "--model",
        "tiny",
        "--out",
        str(out),
        "--suffix-max-tokens",
        "5000",
        "--suffix-share",
    ]
    a = build_parser().parse_args(argv)
    assert a.func is bench.cmd_bench and a.max_new_tokens == 6
    assert a.func(a) == 0
    doc = json.loads((out / "records.json").read_text())
    assert doc["methods"] == ["plain", "prompt-lookup"] and doc["reference"] == "plain"
    assert doc["baselines"] == ["plain"]  # hf was not run, so it is no baseline
    assert sorted((r["method"], r["prompt_id"], r["new_tokens"]) for r in doc["records"]) == [
        ("plain", "1", 6),
        ("plain", "2", 6),
        ("prompt-lookup", "1", 6),
        ("prompt-lookup", "2", 6),
    ]
    for r in doc["records"]:
        want = engine.generate(
            fake_encode({"1": "abcabcabcabc abcabc", "2": "xyz xyz xyz xyzxyz"}[r["prompt_id"]]),
            GenerationConfig(max_new_tokens=6),
            None,
        ).token_ids
        assert r["token_ids"] == want and r["equal_to_reference"] is True
    assert doc["mismatches"] == [] and doc["config"]["max_new_tokens"] == 6 and doc["config"]["prompts"] == 2
    assert "| `prompt-lookup` |" in (out / "report.md").read_text()
    # the command stored in the report parses back to the same options
    cmd = shlex.split(doc["config"]["command"])
    assert cmd[:2] == ["treedraft", "bench"]
    b = build_parser().parse_args(cmd[1:])
    keys = (
        "dataset",
        "methods",
        "max_new_tokens",
        "warmup",
        "threads",
        "model",
        "out",
        "temperature",
        "raw",
        "suffix_store",
        "suffix_max_tokens",
        "suffix_share",
    )
    assert {k: getattr(b, k) for k in keys} == {k: getattr(a, k) for k in keys}
    # what changes nothing is said: a method named twice, more prompts than the file has, sampling flags when greedy
    capsys.readouterr()
    more = ["--methods", "plain,none", "--num-prompts", "5", "--top-p", "0.5", "--min-p", "0.1", "--seed", "3"]
    more += ["--out", str(out / "b")]
    a = build_parser().parse_args([*argv, *more])
    assert a.func(a) == 0
    err = capsys.readouterr().err
    assert "--methods names plain more than once" in err and "--num-prompts 5, but there are 2 prompts" in err
    assert "--top-p, --min-p, --seed only shape sampling" in err
    with pytest.raises(BenchError, match="--pld-tokens must be >= 1"):
        bad = build_parser().parse_args([*argv, "--pld-tokens", "0"])
        bad.func(bad)


def test_bench_baselines_not_run_fall_back_to_plain_and_a_run_without_plain_names_no_reference(
    engine: TextGenerator, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """``--baselines X`` with X not among --methods dropped every speedup column (plain's too), with only a note;
    a run without plain wrote "equality is against `None`" and a column headed "= None" (a review)."""
    import treedraft
    from treedraft.cli import build_parser
    from treedraft.models import registry

    monkeypatch.setattr(treedraft, "load", lambda *a, **k: tiny_llm(engine))
    monkeypatch.setattr(registry, "resolve", lambda model: Path("/nonexistent.gguf"))
    common = ["--dataset", str(dataset), "--max-new-tokens", "4", "--warmup", "0", "--no-progress", "--model", "tiny"]
    a = build_parser().parse_args(
        ["bench", *common, "--methods", "plain,prompt-lookup", "--baselines", "medusa", "--out", str(tmp_path / "a")]
    )
    assert a.func(a) == 0
    assert "speedups are against plain instead" in capsys.readouterr().err
    doc = json.loads((tmp_path / "a" / "records.json").read_text())
    assert doc["baselines"] == ["plain"] and "× vs plain" in (tmp_path / "a" / "report.md").read_text()
    (tmp_path / "f").write_text("x")  # a file as --out is named as one (it read "[Errno 17] File exists")
    a = build_parser().parse_args(["bench", *common, "--methods", "plain", "--out", str(tmp_path / "f")])
    with pytest.raises(BenchError, match="--out .*f is a file; give a directory"):
        a.func(a)
    a = build_parser().parse_args(["bench", *common, "--methods", "plain", "--out", str(tmp_path / "a")])
    assert (
        a.func(a) == 0 and "--out " + str(tmp_path / "a") + " already holds a bench report" in capsys.readouterr().err
    )
    a = build_parser().parse_args(["bench", *common, "--methods", "prompt-lookup", "--out", str(tmp_path / "b")])
    assert a.func(a) == 0
    report = (tmp_path / "b" / "report.md").read_text()
    assert "None" not in report and "outputs are not compared (no reference method" in report
    # with another runtime's baseline in such a run too (its paragraph said "may differ from `None`'s")
    from treedraft.bench import report as rep
    from treedraft.bench.harness import BenchResult

    md = rep.markdown_report(BenchResult([], ["llama.cpp", "prompt-lookup"], reference=None, config={}),
                             {rep.ALL_CATEGORIES: {}}, [])  # fmt: skip
    assert "None" not in md and "may differ from treedraft's without a bug" in md


def test_record_mean_accepted_length() -> None:
    r = Record("m", "1", "c", 3, 5, 1.0, 5.0, "length", [1] * 5, accepted_lengths=[1, 3])
    assert r.mean_accepted_length == 2.0
    assert Record("m", "1", "c", 3, 5, 1.0, 5.0, "length", [1] * 5).mean_accepted_length is None


CPUINFO_X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2
"""


def test_machine_info_reads_the_cpu_model_and_speed_flags() -> None:
    """Only the first CPU's lines count; flags come in SPEED_FLAGS order; 'none' / 'unknown' are told apart."""
    assert bench.machine_info(CPUINFO_X86) == {
        "cpu": "Intel(R) Xeon(R) Platinum 8480+",
        "cpu_flags": "avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8",
    }
    assert bench.machine_info("model name\t: Old CPU\nflags\t: fpu sse2 avx\n") == {
        "cpu": "Old CPU",
        "cpu_flags": "none",
    }
    assert bench.machine_info("")["cpu_flags"] == "unknown" and bench.machine_info("")["cpu"]
    here = bench.machine_info()  # this machine: whatever it is, both fields are filled
    assert here["cpu"] and here["cpu_flags"]


def test_bench_writes_to_a_fresh_cache_folder_by_default_and_records_the_machine(
    engine: TextGenerator,
    dataset: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --out the report goes under $TREEDRAFT_CACHE/bench/<date-time> (never into the repo), a second
    run gets its own folder, the printed path is where it wrote, and the report names the CPU it ran on."""
    import shlex

    import treedraft
    from treedraft.cli import build_parser
    from treedraft.models import registry

    llm = tiny_llm(engine)
    monkeypatch.setattr(treedraft, "load", lambda *a, **k: llm)
    monkeypatch.setattr(registry, "resolve", lambda model: Path("/nonexistent.gguf"))
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    argv = [
        "bench",
        "--dataset",
        str(dataset),
        "--methods",
        "plain",
        "--max-new-tokens",
        "2",
        "--warmup",
        "0",
        "--no-progress",
        "--model",
        "tiny",
    ]
    a = build_parser().parse_args(argv)
    assert a.out is None
    assert a.func(a) == 0 and a.func(build_parser().parse_args(argv)) == 0
    runs = sorted((tmp_path / "cache" / "bench").iterdir())
    assert len(runs) == 2 and all((r / "records.json").is_file() for r in runs)
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]  # nothing written relative to the cwd
    wrote = capsys.readouterr().err
    assert all(str(r / "report.md") in wrote for r in runs)
    doc = json.loads((runs[0] / "records.json").read_text())
    assert doc["config"]["cpu"] == bench.machine_info()["cpu"] and doc["config"]["cpu_flags"]
    assert "--out" not in shlex.split(doc["config"]["command"])  # a rerun gets a fresh folder too
    md = (runs[0] / "report.md").read_text()
    assert f"- cpu: `{bench.machine_info()['cpu']}`" in md and "- cpu_flags: `" in md


def test_default_out_dir_never_reuses_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREEDRAFT_CACHE", str(tmp_path))
    first = bench.default_out_dir("20260101-000000")
    assert first == tmp_path / "bench" / "20260101-000000"
    first.mkdir(parents=True)
    second = bench.default_out_dir("20260101-000000")
    assert second == tmp_path / "bench" / "20260101-000000-2"
    second.mkdir()
    assert bench.default_out_dir("20260101-000000").name == "20260101-000000-3"
    assert bench.default_out_dir().parent == tmp_path / "bench"


def test_busy_core_runs_each_method_again_under_load_and_reports_the_ratio(
    engine: TextGenerator, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib
    import time

    from treedraft.bench import harness, report

    state = {"busy": False}

    @contextlib.contextmanager
    def fake_busy():
        state["busy"] = True
        try:
            yield None
        finally:
            state["busy"] = False

    def slow_when_busy(ids: list[int]) -> MethodOutput:
        time.sleep(0.06 if state["busy"] else 0.02)
        return MethodOutput([1, 2, 3])

    monkeypatch.setattr(harness, "busy_process", fake_busy)
    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    res = run_bench(prompts, {"plain": slow_when_busy}, warmup=0, progress=False, busy_core=True)
    assert res.methods == ["plain", "plain+busy"]
    busy = [r for r in res.records if r.method == "plain+busy"]
    assert sorted(r.prompt_id for r in busy) == sorted(p.id for p, _ in prompts)
    assert all(r.equal_to_reference for r in busy)  # compared with the quiet runs
    ratios = report.busy_core_ratios(res)
    assert set(ratios) == {"plain"} and ratios["plain"]["prompts"] == len(prompts)
    assert 2.0 < ratios["plain"]["median"] <= ratios["plain"]["max"] < 6.0
    md = report.markdown_report(res, summarize(res), [])
    assert "## One core busy" in md and "| `plain` |" in md


def test_busy_process_spins_while_the_block_runs() -> None:
    from treedraft.bench.harness import busy_process

    with busy_process() as hog:
        assert hog.poll() is None  # still running
    assert hog.poll() is not None


class DrafterSpy:
    """A text generator that records, at the start of every generation, how many tokens the drafter's
    suffix store already held, then generates with the wrapped one."""

    def __init__(self, inner: TextGenerator) -> None:
        self.inner, self.seen, self.drafters = inner, [], []
        self.eos_token_ids = inner.eos_token_ids

    def generate(self, ids, config, drafter):
        self.seen.append(drafter.store.num_tokens)
        self.drafters.append(drafter)
        return self.inner.generate(ids, config, drafter)


@pytest.mark.parametrize("fresh", [False, True])
def test_fresh_drafter_state_gives_every_run_an_empty_suffix_index(engine: TextGenerator, fresh: bool) -> None:
    from treedraft.drafters.suffix import SuffixDrafter
    from treedraft.drafters.suffix_store import SuffixStore

    shared = SuffixDrafter(SuffixStore(max_tokens=777, share=True), tenant="t")
    spy = DrafterSpy(engine)
    method = EngineMethod(spy, GenerationConfig(max_new_tokens=MAX_NEW), shared, fresh_state=fresh)
    ids = fake_encode("abcabcabcabc abcabc")
    first, second = method(ids), method(ids)
    assert first.token_ids == second.token_ids  # the state changes speed, never the output
    if fresh:  # each run indexed nothing before it, and the drafter the method holds learned nothing
        assert spy.seen == [0, 0] and shared.store.num_tokens == 0
        a, b = spy.drafters
        assert a is not shared and b is not a and a.store is not b.store
        assert (a.tenant, a.store.max_tokens, a.store.share, a.latency) == ("t", 777, True, shared.latency)
        assert a.store.num_tokens > 0  # the run itself was recorded, into its own store only
    else:  # the second run drafts from the first one's recorded output
        assert spy.seen[0] == 0 and spy.seen[1] > 0 and shared.store.num_tokens > spy.seen[1]


def test_fresh_copy_keeps_a_persistent_suffix_store(tmp_path) -> None:
    """bench --suffix-store DIR: every method's fresh copy drafts from (and records into) the store on disk; it used
    to get an empty in-memory index, so the flag did nothing."""
    from treedraft.drafters.hybrid import fresh_copy
    from treedraft.drafters.suffix import SuffixDrafter
    from treedraft.drafters.suffix_store import SuffixStore

    disk = SuffixDrafter(SuffixStore(tmp_path / "store"), tenant="t")
    disk.store.add([1, 2, 3, 4])
    new = fresh_copy(disk)
    assert new is not disk and new.store is disk.store and new.store.num_tokens == 4
    mem = SuffixDrafter(SuffixStore(max_tokens=99))
    mem.store.add([1, 2, 3, 4])
    assert fresh_copy(mem).store.num_tokens == 0 and fresh_copy(mem).store.max_tokens == 99


def test_fresh_copy_of_a_hybrid_restarts_only_its_learning_members() -> None:
    from treedraft.drafters.hybrid import HybridDrafter, fresh_copy
    from treedraft.drafters.suffix import SuffixDrafter
    from treedraft.drafters.suffix_store import SuffixStore

    lookup, suffix = PromptLookupDrafter(), SuffixDrafter(SuffixStore())
    suffix.store.add([1, 2, 3, 4])
    hyb = HybridDrafter([lookup, suffix], name="h", lead_extra=0)
    new = fresh_copy(hyb)
    assert new is not hyb and (new.name, new.lead_extra) == ("h", 0)
    assert new.drafters[0] is lookup  # nothing learned across requests: shared
    assert new.drafters[1].store.num_tokens == 0 and suffix.store.num_tokens == 4
    assert fresh_copy(lookup) is lookup and fresh_copy(None) is None


def test_busy_core_defaults_to_fresh_drafter_state_and_refuses_a_store_next_to_it() -> None:
    import shlex

    from treedraft.bench.cli import _command_line, fresh_drafter_state
    from treedraft.cli import build_parser

    def parse(*extra: str):
        return build_parser().parse_args(["bench", "--model", "tiny", *extra])

    assert fresh_drafter_state(parse()) is False
    assert fresh_drafter_state(parse("--busy-core")) is True
    assert fresh_drafter_state(parse("--fresh-drafter-state")) is True
    assert fresh_drafter_state(parse("--busy-core", "--no-fresh-drafter-state")) is False
    assert fresh_drafter_state(parse("--suffix-store", "/tmp/x")) is False
    with pytest.raises(BenchError, match="--no-fresh-drafter-state"):
        fresh_drafter_state(parse("--busy-core", "--suffix-store", "/tmp/x"))
    for extra in (["--fresh-drafter-state"], ["--busy-core", "--no-fresh-drafter-state"], []):
        a = parse(*extra)
        again = build_parser().parse_args(shlex.split(_command_line(a, None))[1:])
        assert again.fresh_drafter_state == a.fresh_drafter_state


def test_warm_up_runs_record_nothing_into_the_shared_drafter(engine: TextGenerator) -> None:
    """The warm-up run of the first prompt must not leave its output in a learning drafter's index, or the
    timed run of that prompt drafts its own text (a suffix drafter's bench figure was inflated by it)."""
    from treedraft.drafters.suffix import SuffixDrafter
    from treedraft.drafters.suffix_store import SuffixStore

    shared = SuffixDrafter(SuffixStore(max_tokens=10_000, share=True), tenant="t")
    spy = DrafterSpy(engine)
    method = EngineMethod(spy, GenerationConfig(max_new_tokens=MAX_NEW), shared)
    prompts = [(BenchPrompt("w", "x", "writing"), fake_encode("abcabcabcabc abcabc"))]
    res = run_bench(prompts, {"suffix": method}, warmup=1)
    assert len(spy.seen) == 2 and spy.drafters[0] is not shared  # the warm-up drafted with a copy
    assert spy.seen[1] == 0  # so the timed run started from an empty index
    assert shared.store.num_tokens > 0 and res.records[0].method == "suffix"  # the timed run itself was recorded


def test_each_bench_method_learns_into_its_own_suffix_index(engine: TextGenerator) -> None:
    """Two methods with a suffix member in one run must not share the LLM's in-memory index: the second to run
    a prompt drafted the first one's output of it (hybrid-suffix 5.4 mean accepted on cold first turns)."""
    cfg = GenerationConfig(max_new_tokens=4)
    llm = LLM(engine.engine, None, "tiny", "cpu")
    methods, skipped = bench.build_methods(["suffix"], llm, Path("/nonexistent.gguf"), cfg)
    assert not skipped
    shared = llm.get_drafter("suffix")
    mine = methods["suffix"].drafter
    assert mine is not shared and mine.store is not None and mine.store is not shared.store
    methods["suffix"](fake_encode("abab abab abab"))
    assert mine.store.num_tokens > 0 and shared.store.num_tokens == 0


def test_bench_report_names_the_kernel_build(monkeypatch) -> None:
    """The run config says which native path ran and, when the loaded build was made for another target
    (TREEDRAFT_KERNEL_MARCH: an AVX2 build measured on an AVX-512 machine), that -march, and the report prints it:
    numbers from such a build are not this CPU's best."""
    from treedraft import kernels
    from treedraft.bench import report
    from treedraft.bench.cli import _kernels_line
    from treedraft.bench.harness import BenchResult
    from treedraft.kernels import _build

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    march = _build.build_info()["march"]
    loaded = kernels.paths()[0] + (f" (built with -march={march})" if march else "")
    assert _kernels_line() == loaded
    monkeypatch.setenv(_build.ENV_MARCH, "x86-64-v3")  # set after loading: the loaded build's target counts
    assert _kernels_line() == loaded
    monkeypatch.setitem(_build._state, "march", "x86-64-v3")  # as a build made with it records
    line = _kernels_line()
    assert line == f"{kernels.paths()[0]} (built with -march=x86-64-v3)"
    res = BenchResult(records=[], methods=[], config={"cpu": "X", "kernels": line})
    assert f"- kernels: `{line}`" in report.markdown_report(res, {report.ALL_CATEGORIES: {}}, [])


def test_bench_names_the_llama_cpp_build(monkeypatch) -> None:
    """The report says which llama.cpp build it compared against: the features its system info sets to 1 (an
    AVX2-only build on PYTHONPATH shadows a native one), None when llama-cpp-python is not installed."""
    import sys

    from treedraft.bench.baselines import llama_cpp_build

    fake = SimpleNamespace(
        __version__="9.9.9",
        llama_print_system_info=lambda: b"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | OPENMP = 1 | ",
    )
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    assert llama_cpp_build() == "9.9.9: SSE3 AVX AVX2 OPENMP"
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError
    assert llama_cpp_build() is None


def test_report_says_when_a_baseline_runs_other_weights() -> None:
    """hf (transformers, dequantized fp32) next to int4 treedraft: the report says its tokens may differ and its
    ratios compare different weights; a run without such a baseline says nothing of it."""
    from treedraft.bench import report
    from treedraft.bench.harness import BenchResult

    cfg = {"weights": "int4", "dtype": "float32"}
    md = report.markdown_report(BenchResult([], ["plain", "hf"], config=cfg), {report.ALL_CATEGORIES: {}}, [])
    assert "`hf`: other weights or arithmetic" in md and "treedraft runs `int4` weights" in md
    md = report.markdown_report(BenchResult([], ["plain", "suffix"], config=cfg), {report.ALL_CATEGORIES: {}}, [])
    assert "other weights or arithmetic" not in md and "warmed-store" not in md
    # a shared store on disk: said, since later runs draft from earlier runs' answers
    stored = {**cfg, "suffix_store": "/tmp/s"}
    md = report.markdown_report(BenchResult([], ["plain", "suffix"], config=stored), {report.ALL_CATEGORIES: {}}, [])
    assert "--suffix-store `/tmp/s`" in md and "a warmed-store measurement" in md


def test_a_sampled_run_without_plain_compares_nothing_with_another_librarys_draws(
    engine: TextGenerator, dataset: Path, tmp_path: Path
) -> None:
    """A review (session 44): `--methods hf,prompt-lookup --temperature 1 --seed 1` took hf as the reference and
    listed every sampled output as a mismatch (transformers' draws are not treedraft's coupled ones)."""
    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, sampling=SamplingParams(temperature=1.5, seed=3))
    methods = {
        "hf": wrong_after(EngineMethod(engine, cfg, None), 0),
        "prompt-lookup": EngineMethod(engine, cfg, PromptLookupDrafter()),
    }
    res = run_bench(prompts, methods, reference="hf", greedy=False, seeded=True, warmup=0, progress=False)
    assert res.reference is None and all(r.equal_to_reference is None for r in res.records)
    assert not bench.mismatches(res)
    assert "run `plain` beside them" in write_report(res, tmp_path)["markdown"].read_text()


def test_every_method_failing_is_said_and_the_busy_median_is_the_middle(dataset: Path, tmp_path: Path) -> None:
    """A review (session 44): all methods failing raised ZeroDivisionError (or, with no warm-up, a matplotlib error
    after report.md); the busy-core "median" of 1.0 and 3.0 read 3.0."""
    from treedraft.bench import harness, report

    prompts = [(p, fake_encode(p.text)) for p in load_prompts(dataset)]

    def broken(ids):
        raise RuntimeError("no model")

    with pytest.raises(BenchError, match="every method failed: a: failed on prompt .*no model"):
        run_bench(prompts, {"a": broken, "b": broken}, warmup=1, progress=False)
    res = run_bench(prompts[:2], {"a": broken}, warmup=0, progress=False)
    write_report(res, tmp_path)  # nothing ran: the report says so, the plot has no legend

    def rec(m: str, p, wall: float):
        return harness.Record(m, p.id, p.category, 3, 1, wall, 1.0 / wall, "length", [1])

    quiet = [rec("plain", p, 1.0) for p, _ in prompts[:2]]
    busy = [rec("plain+busy", p, w) for (p, _), w in zip(prompts[:2], (1.0, 3.0))]
    res2 = harness.BenchResult(quiet + busy, ["plain", "plain+busy"], {}, None, [], True, {})
    assert report.busy_core_ratios(res2)["plain"]["median"] == 2.0

"""Training plumbing: prompt files, data-cache meta, checkpoint resume, calibration budget, CLI checks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import treedraft
from treedraft.drafters.medusa import MedusaConfig, MedusaHeads
from treedraft.models.tiny import tiny_llama
from treedraft.prompts import PromptFileError, read_prompt_file
from treedraft.training import data as data_mod
from treedraft.training.calibrate import choose_tree, grow_tree, latency_sizes
from treedraft.training.data import DataCacheMismatchError, generate_dataset, load_shards, read_prompts
from treedraft.training.train import (
    CheckpointMismatchError,
    TrainConfig,
    evaluate,
    head_targets,
    rank_accuracy,
    train_heads,
)

BOS = 1


@dataclass
class _Tok:
    eos_token_ids: frozenset = frozenset()


@dataclass
class FakeLLM:
    """What generate_dataset uses of api.LLM; encode_prompt adds a BOS like a raw Gemma model."""

    model: object = field(default_factory=lambda: tiny_llama(seed=4))
    tokenizer: _Tok = field(default_factory=_Tok)
    model_name: str = "tiny-test-model"
    encoded: list = field(default_factory=list)

    def encode_prompt(self, p: str) -> list[int]:
        ids = [BOS] + [2 + ord(c) % 60 for c in p]
        self.encoded.append(ids)
        return ids


PROMPTS = ["ab", "cde", "f", "ghij"]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# prompt files


def test_reads_all_four_formats_first_user_turn(tmp_path) -> None:
    f = _jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "plain"},
            {"question_id": 7, "category": "math", "turns": ["first", "second"]},
            {
                "id": "sg",
                "conversations": [
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "hi there"},
                    {"from": "gpt", "value": "hello"},
                    {"from": "human", "value": "later"},
                ],
            },
            {
                "messages": [
                    {"role": "system", "content": "be nice"},
                    {"role": "user", "content": "question?"},
                    {"role": "assistant", "content": "answer"},
                ]
            },
            "",
        ],
    )
    assert read_prompts(f) == ["plain", "first", "hi there", "question?"]
    ps = read_prompt_file(f)
    assert [(p.id, p.category) for p in ps] == [("1", "general"), ("7", "math"), ("sg", "general"), ("4", "general")]


@pytest.mark.parametrize(
    "row, match",
    [
        ({"conversations": [{"from": "gpt", "value": "only the model speaks"}]}, "conversations"),
        ({"conversations": "not a list"}, "'conversations' must be a list"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "first 'role': 'user'"),
        ({"text": "unknown key"}, "no prompt found; expected a 'prompt' string"),
        (["a", "list"], "expected a JSON object"),
        ("{broken", "not valid JSON"),
    ],
)
def test_bad_records_name_file_line_and_format(tmp_path, row, match) -> None:
    f = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(PromptFileError, match=match) as e:
        read_prompts(f)
    assert "bad.jsonl:2" in str(e.value)


def test_directory_and_missing_file_are_clear_errors(tmp_path) -> None:
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompts(tmp_path)
    with pytest.raises(PromptFileError, match="does not exist"):
        read_prompts(tmp_path / "nope.jsonl")


def test_a_prompt_file_with_a_byte_order_mark_reads_and_one_not_in_utf8_is_named(tmp_path) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + '{"prompt": "caf\u00e9"}\n'.encode())
    assert [p.text for p in read_prompt_file(bom)] == ["café"]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "a"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(PromptFileError, match="latin.jsonl:2: not UTF-8 text.*save the file as UTF-8"):
        read_prompt_file(latin)


def test_bench_uses_the_same_reader(tmp_path) -> None:
    from treedraft.bench import BenchError, load_prompts

    f = _jsonl(tmp_path / "p.jsonl", [{"id": "a", "conversations": [{"from": "human", "value": "hey"}]}])
    assert [(p.id, p.text) for p in load_prompts(f)] == [("a", "hey")]
    with pytest.raises(BenchError, match="p.jsonl:1"):
        load_prompts(_jsonl(tmp_path / "p.jsonl", [{"messages": []}]))


# ---------------------------------------------------------------------------------------------
# data cache


def test_dataset_uses_llm_encode_prompt_and_writes_meta_first(tmp_path, monkeypatch) -> None:
    llm = FakeLLM()
    seen = []
    real = data_mod.batched_greedy

    def spy(model, prompts, n, eos):
        meta = json.loads((tmp_path / "d" / "meta.json").read_text())  # already there before any shard
        assert meta["complete"] is False and meta["max_new_tokens"] == 3
        seen.extend(prompts)
        return real(model, prompts, n, eos)

    monkeypatch.setattr(data_mod, "batched_greedy", spy)
    generate_dataset(
        llm,
        PROMPTS,
        tmp_path / "d",
        max_new_tokens=3,
        batch_size=2,
        shard_size=2,
        progress=False,
        prompt_file="prompts.jsonl",
    )
    assert sorted(map(tuple, seen)) == sorted(tuple(llm.encode_prompt(p)) for p in PROMPTS)
    assert all(ids[0] == BOS for ids in seen)
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["complete"] is True
    assert {
        k: meta[k] for k in ("model", "max_new_tokens", "max_prompt_tokens", "prompts", "num_prompts", "shard_size")
    } == {
        "model": "tiny-test-model",
        "max_new_tokens": 3,
        "max_prompt_tokens": 384,
        "prompts": 4,
        "num_prompts": 4,
        "shard_size": 2,
    }
    assert meta["prompt_file"].endswith("prompts.jsonl") and len(meta["prompts_sha1"]) == 40


@pytest.mark.parametrize(
    "change, flag",
    [
        ({"max_new_tokens": 4}, "--max-new-tokens"),
        ({"max_prompt_tokens": 3}, "--max-prompt-tokens"),
        ({"prompts": ["ab", "cde", "f", "XYZ"]}, "--prompts"),
        ({"model_name": "another-model"}, "--model"),
    ],
)
def test_resume_with_other_settings_is_refused(tmp_path, change, flag) -> None:
    d = tmp_path / "cache"
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=3, shard_size=2, progress=False)
    before = sorted(p.name for p in d.iterdir())
    kw = {"max_new_tokens": 3, "shard_size": 2, "progress": False, "max_prompt_tokens": 384}
    prompts = change.pop("prompts", PROMPTS)
    llm = FakeLLM(model_name=change.pop("model_name", "tiny-test-model"))
    kw.update(change)
    with pytest.raises(DataCacheMismatchError) as e:
        generate_dataset(llm, prompts, d, **kw)
    assert str(d) in str(e.value) and "Delete" in str(e.value) and flag in str(e.value)
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written


def test_same_settings_resume_without_regenerating(tmp_path, monkeypatch) -> None:
    d = tmp_path / "cache"
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=3, shard_size=2, progress=False)
    monkeypatch.setattr(data_mod, "batched_greedy", lambda *a: pytest.fail("regenerated a cached shard"))
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=3, shard_size=2, progress=False)


def test_legacy_directory_is_accepted_and_meta_completed(tmp_path, monkeypatch) -> None:
    """A directory from the older code: meta.json only {model, prompts, max_new_tokens}, other shard size."""
    d = tmp_path / "legacy"
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=3, shard_size=3, progress=False)
    (d / "meta.json").write_text(json.dumps({"model": "tiny-test-model", "prompts": 4, "max_new_tokens": 3}))
    tokens = load_shards(d)[0]
    monkeypatch.setattr(data_mod, "batched_greedy", lambda *a: pytest.fail("regenerated a cached shard"))
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=3, progress=False)  # default shard_size 64
    assert torch.equal(load_shards(d)[0], tokens)  # same shards, no duplicates
    meta = json.loads((d / "meta.json").read_text())
    assert meta["shard_size"] == 3 and meta["complete"] is True and "prompts_sha1" in meta
    # the stored keys are still checked
    with pytest.raises(DataCacheMismatchError, match="max_new_tokens 3"):
        generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=5, progress=False)


def test_legacy_directory_without_meta_from_more_prompts_is_refused(tmp_path) -> None:
    d = tmp_path / "legacy"
    generate_dataset(FakeLLM(), PROMPTS, d, max_new_tokens=2, shard_size=2, progress=False)
    (d / "meta.json").unlink()
    with pytest.raises(DataCacheMismatchError, match="shard_00001"):
        generate_dataset(FakeLLM(), PROMPTS[:2], d, max_new_tokens=2, shard_size=2, progress=False)
    assert not (d / "meta.json").exists()  # a refused run claims nothing about the directory
    with pytest.raises(DataCacheMismatchError, match="other prompts"):
        generate_dataset(
            FakeLLM(), ["x" * 500] + PROMPTS, d, max_new_tokens=2, shard_size=2, max_prompt_tokens=100, progress=False
        )


def test_cache_names_depend_on_model_and_limits() -> None:
    from treedraft.training.cli import cache_name

    a = cache_name("smollm2-135m-instruct", "../x/sharegpt_prompts.jsonl", 1280, 192, 384)
    assert "smollm2-135m-instruct" in a and "1280" in a and "192" in a
    assert a != cache_name("gemma-3-270m", "../x/sharegpt_prompts.jsonl", 1280, 192, 384)
    assert a != cache_name("smollm2-135m-instruct", "../x/sharegpt_prompts.jsonl", 1280, 256, 384)
    assert "/" not in cache_name("/models/my model.gguf", "p.jsonl", None, 8, 8)


# ---------------------------------------------------------------------------------------------
# training


def _tiny_data(tmp_path: Path) -> tuple[object, Path]:
    from treedraft.training.data import batched_greedy

    m = tiny_llama(seed=2, vocab_size=32)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (3,), generator=g).tolist() for _ in range(8)]
    toks, hids, seqs = [], [], []
    for i, (ans, hid) in enumerate(batched_greedy(m, prompts, 8, frozenset())):
        toks.append(torch.tensor(ans))
        hids.append(hid.half())
        seqs.append(torch.full((len(ans),), i))
    d = tmp_path / "data"
    d.mkdir()
    save_file(
        {"tokens": torch.cat(toks).int(), "hidden": torch.cat(hids), "seq": torch.cat(seqs).int()},
        str(d / "shard_00000.safetensors"),
    )
    return m, d


def _mcfg(m, **kw) -> MedusaConfig:
    return MedusaConfig(base_model="tiny", hidden_size=m.hidden_size, vocab_size=m.vocab_size, **kw)


TC = TrainConfig(epochs=1, batch_size=16, heldout_frac=0.0, checkpoint_every=1)


@pytest.mark.parametrize(
    "mkw, tcfg, match",
    [
        ({"num_heads": 3}, TC, "num_heads 2 \\(now 3\\) \\[--num-heads\\]"),
        ({"num_heads": 2, "draft_vocab": 8}, TC, "draft_vocab 0 \\(now 8\\) \\[--draft-vocab\\]"),
        ({"num_heads": 2, "shared_lm_head": False}, TC, "shared_lm_head True \\(now False\\) \\[--projection\\]"),
        ({"num_heads": 2, "num_layers": 2}, TC, "num_layers 1 \\(now 2\\)"),
        (
            {"num_heads": 2},
            TrainConfig(epochs=3, batch_size=16, heldout_frac=0.0),
            "epochs 1 \\(now 3\\) \\[--epochs\\]",
        ),
    ],
)
def test_resume_with_other_heads_or_run_is_refused(tmp_path, mkw, tcfg, match) -> None:
    m, d = _tiny_data(tmp_path)
    train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=2), TC, tmp_path / "o", progress=False)
    ck = tmp_path / "o" / "checkpoint.pt"
    st = torch.load(ck, weights_only=False)
    assert st["medusa_config"]["num_heads"] == 2 and st["train_config"]["epochs"] == 1
    json.dumps(st["medusa_config"])  # stored as a JSON-able dict
    with pytest.raises(CheckpointMismatchError, match=match) as e:
        train_heads(d, m.lm_head.weight, _mcfg(m, **mkw), tcfg, tmp_path / "o", progress=False)
    assert str(ck) in str(e.value) and "--init-from <its --out> --out NEW_DIR" in str(e.value)  # (train further)
    # the same run resumes (nothing left to do) and gives the same heads
    h, _ = train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=2), TC, tmp_path / "o", progress=False)
    assert torch.equal(h.state_dict()["blocks.0.0.linear.weight"], st["heads"]["blocks.0.0.linear.weight"])


def test_old_checkpoint_without_configs_gives_a_clear_error(tmp_path) -> None:
    m, d = _tiny_data(tmp_path)
    train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=2), TC, tmp_path / "o", progress=False)
    ck = tmp_path / "o" / "checkpoint.pt"
    st = torch.load(ck, weights_only=False)
    torch.save({k: st[k] for k in ("heads", "opt", "step")}, ck)  # the format before configs were stored
    with pytest.raises(CheckpointMismatchError, match="--num-heads"):
        train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=3), TC, tmp_path / "o", progress=False)
    train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=2), TC, tmp_path / "o", progress=False)  # still resumes


def test_topk_accuracy_is_cumulative_rank_accuracy() -> None:
    m = tiny_llama(seed=5, vocab_size=32)
    vm = torch.randperm(32, generator=torch.Generator().manual_seed(1))[:12]
    heads = MedusaHeads(_mcfg(m, num_heads=3, draft_vocab=12), m.lm_head.weight, vm)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    g = torch.Generator().manual_seed(2)
    hid = torch.randn(200, m.hidden_size, generator=g)
    tok = torch.randint(0, 32, (200,), generator=g)
    seq = torch.arange(200) // 20
    tg = head_targets(tok, seq, 3)
    ev = evaluate(heads, hid, tg, ks=(1, 3, 5))
    ra = torch.tensor(rank_accuracy(heads, hid, tg, max_rank=5))
    for k in (1, 3, 5):
        torch.testing.assert_close(torch.tensor(ev[f"top{k}"]), ra[:, :k].sum(-1))
    # and both agree with a direct count
    top = vm[heads(hid).topk(5, dim=-1).indices]  # (N, K, 5)
    ok = tg >= 0
    direct = ((top == tg[..., None]).any(-1) & ok).sum(0) / ok.sum(0)
    torch.testing.assert_close(torch.tensor(ev["top5"]), direct.float())
    # a rank beyond the draft vocabulary is simply never right
    assert rank_accuracy(heads, hid, tg, max_rank=20)[0][12:] == [0.0] * 8


# ---------------------------------------------------------------------------------------------
# calibration


ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]


@pytest.mark.parametrize("max_nodes", [1, 2, 5, 16])
def test_max_nodes_counts_the_root(max_nodes) -> None:
    res = choose_tree(ACC, {1: 1.0, max_nodes: 1.0}, max_nodes=max_nodes)  # free tokens: take the whole budget
    assert res["nodes"] == max_nodes - 1 == len(res["choices"])
    assert res["tree_tokens"] == max_nodes
    assert res["warnings"] == []
    assert res["expected_len"] == pytest.approx(1 + sum(grow_tree(ACC, max_nodes - 1)[1]))


def test_latency_beyond_the_measured_sizes_is_reported() -> None:
    res = choose_tree(ACC, {1: 1.0, 2: 1.0, 4: 1.0}, max_nodes=8)
    assert res["warnings"] and "extrapolated" in res["warnings"][0] and "8" in res["warnings"][0]
    assert choose_tree(ACC, {1: 1.0, 2: 1.0, 4: 1.0}, max_nodes=4)["warnings"] == []


def test_latency_sizes_reach_the_budget() -> None:
    assert latency_sizes(64)[-1] == 64 and latency_sizes(64)[0] == 1
    assert latency_sizes(20) == [1, 2, 4, 8, 12, 16, 20]
    assert latency_sizes(100)[-1] == 100
    assert latency_sizes(1) == [1]
    with pytest.raises(ValueError, match="root"):
        latency_sizes(0)


# ---------------------------------------------------------------------------------------------
# CLI argument checks (all fail before any model is loaded)


def _main(argv: list[str], capsys) -> tuple[int, str]:
    from treedraft.cli import main

    rc = main(argv)
    return rc, capsys.readouterr().err


SHIPPED_HEADS = str(Path(treedraft.__file__).parent / "heads" / "smollm2-135m-instruct")


@pytest.mark.parametrize(
    "args, match",
    [
        (["--num-heads", "0"], "--num-heads must be >= 1"),
        (["--num-layers", "0"], "--num-layers must be >= 1"),
        (["--draft-vocab", "-1"], "--draft-vocab must be >= 0"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--extra-train-data", "nowhere"], "--extra-train-data nowhere: no shard"),
        (["--init-from", "nowhere"], "--init-from nowhere: no medusa.json"),
        (["--init-from", SHIPPED_HEADS, "--num-heads", "3"], "--num-heads: the heads' shape comes from --init-from"),
        (["--init-from", SHIPPED_HEADS, "--no-root-conditioned"], "--root-conditioned: the heads'"),
    ],
)
def test_train_heads_validates_arguments(tmp_path, capsys, args, match) -> None:
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    rc, err = _main(["train-heads", "--out", str(tmp_path / "o"), "--prompts", str(p), *args], capsys)
    assert rc == 2 and match in err


def test_data_of_another_model_or_prompt_count_and_a_file_as_out_are_said(tmp_path, capsys) -> None:
    """A data directory made by another model is refused (train-heads checked --train-data only, train-eagle and
    calibrate's --eval-data nothing); --out as a file is refused before any work; --num-prompts beyond the file is
    said (the smaller run was silent)."""
    import json

    from treedraft.prompts import first_prompts
    from treedraft.training.cli import check_data_model, check_out_dir

    for name, meta in (
        ("other", {"model": "gemma-3-270m", "model_file": "g.gguf:9"}),
        ("mine", {"model": "/a/m.gguf", "model_file": "m.gguf:5"}),  # the same file, its path spelled another way
        ("named", {"model": "m"}),  # written before the file was recorded
        ("old", None),  # no meta.json at all
    ):
        (tmp_path / name).mkdir()
        if meta is not None:
            (tmp_path / name / "meta.json").write_text(json.dumps(meta))
    me = {"model": "m", "model_file": "m.gguf:5"}
    check_data_model(me, [tmp_path / "mine", tmp_path / "named", tmp_path / "old"])
    with pytest.raises(ValueError, match="answers of model 'gemma-3-270m' .*, not of 'm'"):
        check_data_model(me, [tmp_path / "mine", tmp_path / "other"])
    with pytest.raises(ValueError, match="answers of model 'm'"):
        check_data_model({"model": "other"}, [tmp_path / "named"])  # names alone decide where no file is recorded
    (tmp_path / "f").write_text("x")
    check_out_dir(str(tmp_path / "new" / "dir"))
    for bad in (tmp_path / "f", tmp_path / "f" / "sub"):
        with pytest.raises(ValueError, match="is a file"):
            check_out_dir(str(bad))
    assert first_prompts([1, 2], 1, "p.jsonl") == [1] and capsys.readouterr().err == ""
    assert first_prompts([1, 2], 5, "p.jsonl") == [1, 2]
    assert "--num-prompts 5, but p.jsonl has 2 prompts" in capsys.readouterr().err
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    rc, err = _main(["train-heads", "--out", str(tmp_path / "f"), "--prompts", str(p)], capsys)
    assert rc == 2 and "--out" in err and "is a file" in err


def test_train_heads_missing_prompt_file(tmp_path, capsys) -> None:
    rc, err = _main(["train-heads", "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "none.jsonl")], capsys)
    assert rc == 2 and "no such file" in err
    rc, err = _main(["train-heads", "--out", str(tmp_path / "o"), "--prompts", str(tmp_path)], capsys)
    assert rc == 2 and "a directory; give a prompt file" in err  # (it said "no such file": a review)


def test_train_heads_says_a_short_prompt_file_only_for_a_num_prompts_given(tmp_path, capsys) -> None:
    """Without --num-prompts a file of 3 prompts warned "--num-prompts 1280, but ... has 3 prompts" about a flag the
    user never passed (a review); with it, the warning stays. The default is still 1280 (its data cache's name)."""
    from treedraft.cli import build_parser
    from treedraft.prompts import first_prompts
    from treedraft.training import cli as tcli
    from treedraft.training.data import read_prompts

    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"x{i}"} for i in range(3)])
    for extra, want, warned in (([], tcli.NUM_PROMPTS, False), (["--num-prompts", "7"], 7, True)):
        a = build_parser().parse_args(["train-heads", "--out", str(tmp_path / "o"), "--prompts", str(p), *extra])
        tcli.validate_train_args(a)  # (what cmd_train runs before the model load and this selection)
        assert a.num_prompts == want
        capsys.readouterr()
        assert len(first_prompts(read_prompts(a.prompts), a.num_prompts, a.prompts, warn=a.num_prompts_given)) == 3
        assert ("has 3 prompts" in capsys.readouterr().err) == warned
    assert tcli.NUM_PROMPTS == 1280


def test_calibrate_validates_arguments(tmp_path, capsys, monkeypatch) -> None:
    rc, err = _main(["calibrate", "--max-nodes", "0"], capsys)
    assert rc == 2 and "--max-nodes counts the root" in err
    rc, err = _main(["calibrate", "--check-file", str(tmp_path)], capsys)  # a directory is not a prompt file
    assert rc == 2 and "--check-file" in err
    (tmp_path / "eagle1").mkdir()  # an EAGLE drafter's directory: it said to pick a --drafter calibrate does not have
    (tmp_path / "eagle1" / "eagle.json").write_text("{}")
    rc, err = _main(["calibrate", "--heads", str(tmp_path / "eagle1")], capsys)
    assert rc == 2 and "calibrate chooses a Medusa tree only" in err
    import treedraft.training.cli as tcli

    monkeypatch.setattr(tcli, "find_shared_data", lambda name: None)  # no MT-Bench file next to the repo
    rc, err = _main(["calibrate"], capsys)
    assert rc == 2 and "--check-file FILE, or --check-prompts 0" in err
    rc, err = _main(["calibrate", "--check-prompts", "0", "--eval-data", str(tmp_path / "nope")], capsys)
    assert rc == 2 and "--eval-data" in err and "train-heads" in err
    (tmp_path / "empty.jsonl").write_text("")
    rc, err = _main(["calibrate", "--check-file", str(tmp_path / "empty.jsonl")], capsys)  # before the measurement
    assert rc == 2 and "has no prompts" in err


def test_eagle_format_shards_give_their_answer_rows_and_directories_stay_apart(tmp_path) -> None:
    """train-eagle's shards (prompt positions + answer flags) train heads on the answer rows only; several
    directories keep their sequences apart, so no head target crosses from one directory into the next."""
    from safetensors.torch import save_file

    from treedraft.training.data import load_many_shards
    from treedraft.training.train import head_targets

    m, d = _tiny_data(tmp_path)
    tok, hid, seq = load_shards(d)
    e = tmp_path / "eagle"
    e.mkdir()
    prompt_rows = 3 * len(seq.unique())
    save_file(  # each sequence preceded by 3 prompt rows (token 31, hidden 7)
        {
            "tokens": torch.cat([torch.cat([torch.full((3,), 31), tok[seq == i]]) for i in seq.unique()]).int(),
            "hidden": torch.cat([torch.cat([torch.full((3, hid.shape[1]), 7.0).half(), hid[seq == i]]) for i in seq.unique()]),
            "seq": torch.cat([torch.full((3 + int((seq == i).sum()),), int(i)) for i in seq.unique()]).int(),
            "answer": torch.cat([torch.tensor([0, 0, 0] + [1] * int((seq == i).sum())) for i in seq.unique()]).to(torch.int8),
        },
        str(e / "shard_00000.safetensors"),
    )  # fmt: skip
    t2, h2, s2 = load_shards(e)
    assert torch.equal(t2, tok) and torch.equal(h2, hid) and torch.equal(s2, seq) and prompt_rows > 0
    t3, h3, s3 = load_many_shards([d, e])
    assert torch.equal(t3, torch.cat([tok, tok])) and torch.equal(h3, torch.cat([hid, hid]))
    assert not set(s3[: len(seq)].tolist()) & set(s3[len(seq) :].tolist())
    tg = head_targets(t3, s3, 2)
    last = len(seq) - 1  # the first directory's last row: nothing after it in its sequence
    assert tg[last].tolist() == [-100, -100]


def _shifted_copy(d: Path, out: Path) -> Path:
    """The same shards with every token id moved by 5 (mod 32): another frequency order."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in d.glob("shard_*.safetensors"):
        t = load_file(str(f))
        t["tokens"] = (t["tokens"] + 5) % 32
        save_file(t, str(out / f.name))
    return out


def test_init_from_heads_starts_from_their_weights_and_vocabulary(tmp_path) -> None:
    m, d = _tiny_data(tmp_path)
    a, _ = train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=2, draft_vocab=8), TC, tmp_path / "a", progress=False)
    other = _shifted_copy(d, tmp_path / "other")  # data whose own draft vocabulary differs
    still = TrainConfig(epochs=1, batch_size=16, heldout_frac=0.0, lr=1e-12, seed=5)
    b, _ = train_heads(other, m.lm_head.weight, a.config, still, tmp_path / "b", progress=False, init=a)
    c, _ = train_heads(other, m.lm_head.weight, a.config, still, tmp_path / "c", progress=False)
    assert not torch.equal(c.vocab_map, a.vocab_map)
    w = "blocks.0.0.linear.weight"
    assert a.state_dict()[w].abs().max() > 1e-5  # trained away from the zero init
    torch.testing.assert_close(b.state_dict()[w], a.state_dict()[w], atol=1e-9, rtol=0)
    assert not torch.allclose(c.state_dict()[w], a.state_dict()[w], atol=1e-6, rtol=0)  # fresh heads differ
    assert torch.equal(b.vocab_map, a.vocab_map)
    with pytest.raises(CheckpointMismatchError, match=r"started from fresh heads \(now these initial heads\)"):
        train_heads(other, m.lm_head.weight, a.config, still, tmp_path / "c", progress=False, init=a)  # c's ckpt
    with pytest.raises(CheckpointMismatchError, match=r"started from other initial heads \(now fresh heads\)"):
        train_heads(other, m.lm_head.weight, a.config, still, tmp_path / "b", progress=False)  # b's ckpt
    with pytest.raises(ValueError, match="initial heads' config"):
        train_heads(d, m.lm_head.weight, _mcfg(m, num_heads=3, draft_vocab=8), still, tmp_path / "x", progress=False,
                    init=a)  # fmt: skip


class _TinyLLM:
    """What train-heads reads of a loaded model (treedraft.load's result), over a tiny seeded Llama."""

    def __init__(self, m) -> None:
        self.model, self.model_name = m, "tiny"


@pytest.mark.parametrize("with_eval", [False, True])
def test_train_heads_no_generate_generates_nothing(tmp_path, capsys, monkeypatch, with_eval) -> None:
    """--no-generate trains on --train-data and never answers prompts: without --eval-data it says that the heads
    go unevaluated (no rank accuracies); with it they are evaluated on that directory as it is."""
    import json

    import treedraft.training.data as data_mod

    m, d = _tiny_data(tmp_path)
    (d / "meta.json").write_text(json.dumps({"model": "tiny"}))
    monkeypatch.setattr(treedraft, "load", lambda *a, **k: _TinyLLM(m))

    def no_generation(*a, **k):
        raise AssertionError("--no-generate generated answers")

    monkeypatch.setattr(data_mod, "generate_dataset", no_generation)
    p = _jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}])
    out = tmp_path / "heads"
    gone = tmp_path / "nothere.jsonl"  # never read under --no-generate (a review: it was required, and recorded)
    argv = ["train-heads", "--no-generate", "--train-data", str(d), "--prompts", str(gone), "--eval-prompts", str(p)]
    argv += ["--num-heads", "2", "--draft-vocab", "0", "--epochs", "1", "--out", str(out)] + (
        ["--eval-data", str(d)] if with_eval else []
    )
    rc, err = _main(argv, capsys)
    assert rc == 0, err
    extra = json.loads((out / "medusa.json").read_text())["extra"]
    assert extra["prompts"] is None and extra["num_prompts"] is None and extra["train_data"] == str(d)
    if with_eval:
        assert extra["eval_data"] == str(d) and len(extra["rank_accuracy"]) == 2
        assert extra["training"]["eval_prompts"] == str(d)  # what the "mt_bench" block measured (any prompts)
        assert "no evaluation" not in err
    else:
        assert extra["eval_data"] is None and "rank_accuracy" not in extra
        assert "--no-generate without --eval-data: no evaluation" in err


def test_no_fitting_prompt_says_which_flags_to_change() -> None:
    from types import SimpleNamespace

    from treedraft.training.data import encode_fitting

    llm = SimpleNamespace(encode_prompt=lambda p: list(range(len(p))))
    assert encode_fitting(llm, ["abc", "x" * 50, "de"], 10) == [(0, [0, 1, 2]), (2, [0, 1])]
    with pytest.raises(
        ValueError, match="none of the 2 prompts fits in max_prompt_tokens=10: raise --max-prompt-tokens"
    ):
        encode_fitting(llm, ["x" * 50, "y" * 11], 10)


def _copy_with_meta(src: Path, out: Path, prompts_sha1: str) -> Path:
    import shutil

    shutil.copytree(src, out)
    (out / "meta.json").write_text(json.dumps({"model": "tiny", "prompts_sha1": prompts_sha1}))
    return out


def test_answers_to_held_out_prompts_are_held_out_in_every_directory_of_those_prompts(tmp_path) -> None:
    """A review (session 44): train-eagle's data beside a copy over the same prompt file (--extra-train-data) trained
    on the held-out prompts through the copy, and the held-out top-1 rose from 0.71 to 0.93."""
    from treedraft.training.data import load_many_shards
    from treedraft.training.train import hold_out_copies, split_by_sequence

    m, d = _tiny_data(tmp_path)
    a = _copy_with_meta(d, tmp_path / "a", "same")
    b = _copy_with_meta(d, tmp_path / "b", "same")
    c = _copy_with_meta(d, tmp_path / "c", "other")  # other prompts: its sequence 3 is another prompt's answer
    tok, hid, seq, offsets, rows = load_many_shards([a, b, c], with_offsets=True)
    held = split_by_sequence(seq, 0.25, 0)
    raw = {int(s) - offsets[0] if s < offsets[1] else int(s) - offsets[1] for s in seq[held].unique() if s < offsets[2]}
    assert raw  # something of a or b is held out by the plain split
    got = hold_out_copies(held, seq, offsets, ["same", "same", "other"])  # (a, b, c: their prompts_sha1)
    for lo in offsets[:2]:  # a's and b's answers to every prompt held out in either
        for r in raw:
            assert got[seq == lo + r].all()
    assert torch.equal(got[seq >= offsets[2]], held[seq >= offsets[2]])  # c's own split untouched
    seq2 = load_many_shards([a, b])[2]
    held2 = split_by_sequence(seq2, 0.25, 0)
    raw2 = {int(s) % offsets[1] for s in seq2[held2].unique()}
    tc = TrainConfig(epochs=1, batch_size=16, heldout_frac=0.25)
    _, report = train_heads([a, b], m.lm_head.weight, _mcfg(m, num_heads=2), tc, tmp_path / "o", progress=False)
    assert raw2 and report["heldout_rows"] == 2 * sum(int((seq == r).sum()) for r in raw2)  # (a's ids: raw)


def test_no_training_rows_is_an_error_not_zero_heads(tmp_path) -> None:
    """A single prompt: the split keeps it for training; answered twice (two copies of its data), one copy held out
    holds the other out too, and nothing is left to train on: said, where zero heads were written before."""
    from safetensors.torch import load_file, save_file

    m, d = _tiny_data(tmp_path)
    one = load_file(str(d / "shard_00000.safetensors"))
    keep = one["seq"] == 0
    (tmp_path / "one").mkdir()
    save_file({k: v[keep].contiguous() for k, v in one.items()}, str(tmp_path / "one" / "shard_00000.safetensors"))
    _, report = train_heads(
        tmp_path / "one",
        m.lm_head.weight,
        _mcfg(m, num_heads=2),
        TrainConfig(epochs=1, heldout_frac=0.1),
        tmp_path / "o1",
        progress=False,
    )
    assert report["train_rows"] == int(keep.sum()) and report["heldout_rows"] == 0
    a = _copy_with_meta(tmp_path / "one", tmp_path / "a", "same")
    b = _copy_with_meta(tmp_path / "one", tmp_path / "b", "same")
    with pytest.raises(ValueError, match="no training rows"):
        train_heads(
            [a, b],
            m.lm_head.weight,
            _mcfg(m, num_heads=2),
            TrainConfig(epochs=1, heldout_frac=0.1),
            tmp_path / "o",
            progress=False,
        )
    assert not (tmp_path / "o" / "heads.safetensors").exists()


def test_a_torn_checkpoint_or_reordered_data_is_said_not_a_traceback(tmp_path) -> None:
    m, d = _tiny_data(tmp_path)
    a = _copy_with_meta(d, tmp_path / "a", "pa")
    b = _copy_with_meta(d, tmp_path / "b", "pb")
    tc = TrainConfig(epochs=2, batch_size=16, heldout_frac=0.0, checkpoint_every=1)
    train_heads([a, b], m.lm_head.weight, _mcfg(m, num_heads=2), tc, tmp_path / "o", progress=False)
    ck = tmp_path / "o" / "checkpoint.pt"
    assert not ck.with_name("checkpoint.pt.tmp").exists()  # written whole, then renamed
    with pytest.raises(CheckpointMismatchError, match="training data directories"):
        train_heads([b, a], m.lm_head.weight, _mcfg(m, num_heads=2), tc, tmp_path / "o", progress=False)
    ck.write_bytes(ck.read_bytes()[:1000])  # as an interrupted write left it before saves were atomic
    with pytest.raises(CheckpointMismatchError, match="cannot be read.*delete it"):
        train_heads([a, b], m.lm_head.weight, _mcfg(m, num_heads=2), tc, tmp_path / "o", progress=False)


def test_an_interrupted_save_leaves_no_heads_to_load_and_a_torn_file_is_said(tmp_path, monkeypatch) -> None:
    from treedraft.drafters.medusa import HeadsMismatchError
    from treedraft.models import cache

    m = tiny_llama(seed=2, vocab_size=32)
    heads = MedusaHeads(_mcfg(m, num_heads=2), m.lm_head.weight)
    heads.save(tmp_path / "h")
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == ["heads.safetensors", "medusa.json"]

    def interrupted(path, text):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "atomic_write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        heads.save(tmp_path / "h")  # overwriting: the old config must not stay beside the new weights
    assert not (tmp_path / "h" / "medusa.json").exists()
    monkeypatch.undo()
    heads.save(tmp_path / "h")
    w = tmp_path / "h" / "heads.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(HeadsMismatchError, match="cannot be read"):
        MedusaHeads.load(tmp_path / "h", m.lm_head.weight, "tiny", m.hidden_size, m.vocab_size)

"""EAGLE self-distillation data from the batched scheduler (training/eagle_data.py), on a tiny native model:
the answers are plain greedy decoding's, the features the target's own, resuming skips finished shards."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spec_stats import one_thread  # noqa: F401
from test_batch import native_tiny

from treedraft.engine import Engine, GenerationConfig
from treedraft.training import eagle_data
from treedraft.training.data import DataCacheMismatchError
from treedraft.training.eagle_data import PROGRESS_FILE, generate_eagle_dataset
from treedraft.training.eagle_train import load_eagle_shards

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 12
PROMPTS = ["ab", "cdefg", "h", "ijkl", "mnopqrs", "tu", "vwxyz"]


@dataclass
class _Tok:
    eos_token_ids: frozenset = frozenset()


@dataclass
class FakeLLM:
    """What generate_eagle_dataset uses of api.LLM (engine, tokenizer.eos_token_ids, encode_prompt, model_name)."""

    engine: Engine = field(default_factory=lambda: Engine(native_tiny(seed=3)))
    tokenizer: _Tok = field(default_factory=_Tok)
    model_name: str = "tiny-native-test"

    def encode_prompt(self, p: str) -> list[int]:
        return [1] + [2 + ord(c) % 60 for c in p]


def plain(llm: FakeLLM, ids: list[int]) -> list[int]:
    """Plain greedy decoding (no drafter), cut after the first EOS."""
    out = llm.engine.generate(ids, GenerationConfig(max_new_tokens=NEW, ignore_eos=True), drafter=None).token_ids
    end = next((i + 1 for i, t in enumerate(out) if t in llm.tokenizer.eos_token_ids), len(out))
    return out[:end]


def by_prompt(d: Path) -> dict[int, tuple[list[int], torch.Tensor, list[int]]]:
    """prompt index -> (tokens, hidden, answer flags) from the shards in ``d``."""
    data = load_eagle_shards(d)
    out = {}
    for i in data["seq"].unique().tolist():
        m = data["seq"] == i
        out[i] = (data["tokens"][m].tolist(), data["hidden"][m], data["answer"][m].int().tolist())
    return out


def test_data_equals_plain_greedy_and_teacher_forced_features(tmp_path: Path) -> None:
    llm = FakeLLM()
    first = [plain(llm, llm.encode_prompt(p)) for p in PROMPTS]
    # an EOS that some answers reach early: answers must end there (EOS kept), the others run to NEW
    llm.tokenizer.eos_token_ids = frozenset({first[1][4]})
    generate_eagle_dataset(llm, PROMPTS, tmp_path, max_new_tokens=NEW, concurrency=3, shard_size=3, progress=False)
    rows = by_prompt(tmp_path)
    assert sorted(rows) == list(range(len(PROMPTS)))
    lengths = set()
    model = llm.engine.model
    for i, p in enumerate(PROMPTS):
        ids = llm.encode_prompt(p)
        answer = plain(llm, ids)
        lengths.add(len(answer))
        toks, hid, ans = rows[i]
        assert toks == ids[1:] + answer
        assert ans == [0] * (len(ids) - 1) + [1] * len(answer)
        # features: the final-norm hidden state at positions 0 .. P+A-2 of a teacher-forced pass
        seq = torch.tensor([ids + answer[:-1]])
        _, ref = model(seq, torch.arange(seq.shape[1]), model.new_cache(seq.shape[1]), 0)
        assert hid.shape == (len(toks), model.hidden_size) and hid.dtype == torch.float16
        torch.testing.assert_close(hid.float(), ref[0].half().float(), atol=2e-2, rtol=2e-2)
    assert min(lengths) < NEW and max(lengths) == NEW  # the EOS cut happened, and not everywhere


def test_batched_equals_one_at_a_time(tmp_path: Path) -> None:
    """Row-invariant native linears: an answer and its features do not depend on what it was batched with."""
    llm = FakeLLM()
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "a", max_new_tokens=NEW, concurrency=1, progress=False)
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "b", max_new_tokens=NEW, concurrency=4, progress=False)
    a, b = by_prompt(tmp_path / "a"), by_prompt(tmp_path / "b")
    for i in a:
        assert a[i][0] == b[i][0]
        assert torch.equal(a[i][1], b[i][1])


def test_resume_skips_finished_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = FakeLLM()
    kw = dict(max_new_tokens=NEW, concurrency=2, shard_size=3, progress=False)
    generate_eagle_dataset(llm, PROMPTS, tmp_path, max_shards=1, **kw)
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == ["shard_00000.safetensors"]
    first = load_file(str(tmp_path / "shard_00000.safetensors"))
    progress = json.loads((tmp_path / PROGRESS_FILE).read_text())  # (it counted the shards past --max-shards: 3 of 1)
    assert progress["shards_done"] == 1 and progress["shards"] == 1

    fed: list[int] = []
    real = eagle_data.scheduled_greedy

    def spy(engine, prompts, *a, **k):
        fed.extend(key for key, _ in prompts)
        yield from real(engine, prompts, *a, **k)

    monkeypatch.setattr(eagle_data, "scheduled_greedy", spy)
    generate_eagle_dataset(llm, PROMPTS, tmp_path, **kw)
    assert sorted(fed) == [3, 4, 5, 6]  # shard 0 (prompts 0-2) was not answered again
    assert sorted(p.name for p in tmp_path.glob("shard_*")) == [f"shard_0000{i}.safetensors" for i in range(3)]
    again = load_file(str(tmp_path / "shard_00000.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)
    fed.clear()
    generate_eagle_dataset(llm, PROMPTS, tmp_path, **kw)
    assert fed == []  # everything done: nothing answered
    # training on a prefix of the shards: the first N must all be there
    assert len(load_eagle_shards(tmp_path, max_shards=2)["seq"].unique()) == 6
    (tmp_path / "shard_00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lower --max-shards"):
        load_eagle_shards(tmp_path, max_shards=2)


def test_sampled_answers_are_seeded_and_kept_apart_from_greedy_data(tmp_path: Path) -> None:
    """--gen-temperature: answers drawn per prompt from seed + index (a rerun gives the same ones), unlike the
    greedy ones somewhere; features still the target's; a directory never mixes greedy and sampled shards."""
    llm = FakeLLM()
    kw = dict(max_new_tokens=NEW, concurrency=3, shard_size=3, progress=False)
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "g", **kw)
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "s", temperature=1.5, seed=7, **kw)
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "s2", temperature=1.5, seed=7, concurrency=1, progress=False,
                           max_new_tokens=NEW)  # fmt: skip
    g, s, s2 = by_prompt(tmp_path / "g"), by_prompt(tmp_path / "s"), by_prompt(tmp_path / "s2")
    assert all(s[i][0] == s2[i][0] for i in s)  # seeded per prompt: batching does not change the draws
    assert any(s[i][0] != g[i][0] for i in s)
    model = llm.engine.model
    toks, hid, ans = s[3]
    ids = [1, *toks[: len(toks) - sum(ans)]]  # the prompt ids (its first token is not a target)
    answer = toks[len(ids) - 1 :]
    seq = torch.tensor([ids + answer[:-1]])
    _, ref = model(seq, torch.arange(seq.shape[1]), model.new_cache(seq.shape[1]), 0)
    torch.testing.assert_close(hid.float(), ref[0].half().float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(DataCacheMismatchError, match="--gen-temperature"):
        generate_eagle_dataset(llm, PROMPTS, tmp_path / "s", **kw)  # greedy into the sampled directory
    with pytest.raises(DataCacheMismatchError, match="--gen-seed"):
        generate_eagle_dataset(llm, PROMPTS, tmp_path / "s", temperature=1.5, seed=8, **kw)
    meta = tmp_path / "g" / "meta.json"  # a greedy directory written before the temperature was recorded
    meta.write_text(meta.read_text().replace('"temperature": 0.0,', ""))
    with pytest.raises(DataCacheMismatchError, match="holds greedy answers"):
        generate_eagle_dataset(llm, PROMPTS, tmp_path / "g", temperature=1.5, seed=7, **kw)


@pytest.mark.parametrize(
    "args,msg",
    [
        ([], "--out DIR is required"),
        (["--gen-only", "--no-generate", "--train-data", "x"], "exclude each other"),
        (["--out", "o", "--max-shards", "0"], "--max-shards must be >= 1"),
        (["--out", "o", "--gen-concurrency", "0"], "--gen-concurrency"),
        (["--out", "o", "--gen-temperature", "-1"], "--gen-temperature must be >= 0"),
        (["--out", "o", "--extra-train-data", "nowhere"], "--extra-train-data nowhere: no shard"),
        (["--out", "o", "--init-from", "d", "--init-from-target"], "give one"),
        (["--out", "p.jsonl"], "is a file"),  # said before the data step and an epoch, not after them
        (["--out", "o", "--init-from", "nowhere"], "no eagle.json there"),  # (was said after the data step: hours)
    ],
)
def test_train_eagle_cli_checks(tmp_path: Path, args: list[str], msg: str) -> None:
    import argparse

    from treedraft.training import eagle_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    p = argparse.ArgumentParser()
    eagle_cli.register(p.add_subparsers())
    args = [str(prompts) if x == "p.jsonl" else x for x in args]
    a = p.parse_args(["train-eagle", "--prompts", str(prompts), *args])
    with pytest.raises(ValueError, match=msg):
        eagle_cli.validate(a)
    ok = p.parse_args(["train-eagle", "--prompts", str(prompts), "--gen-only", "--max-shards", "2"])
    eagle_cli.validate(ok)  # the data-only run needs no --out


def test_heads_read_the_eagle_data_as_their_own(tmp_path: Path) -> None:
    """train-heads on train-eagle's data: load_shards keeps the answer rows, which are then the heads' own data
    (row j: the hidden state that chose token j, from the last prompt position on)."""
    from treedraft.training.data import generate_dataset, load_shards

    llm = FakeLLM()
    llm.model = llm.engine.model  # what generate_dataset (the heads' data step) runs
    generate_eagle_dataset(llm, PROMPTS, tmp_path / "e", max_new_tokens=NEW, concurrency=3, shard_size=3,
                           progress=False)  # fmt: skip
    generate_dataset(llm, PROMPTS, tmp_path / "h", max_new_tokens=NEW, batch_size=3, progress=False)
    e, h = load_shards(tmp_path / "e"), load_shards(tmp_path / "h")
    assert len(e[0]) == len(h[0]) == NEW * len(PROMPTS)  # no prompt rows left
    for i in range(len(PROMPTS)):
        me, mh = e[2] == i, h[2] == i
        assert e[0][me].tolist() == h[0][mh].tolist()
        torch.testing.assert_close(e[1][me].float(), h[1][mh].float(), atol=2e-2, rtol=2e-2)

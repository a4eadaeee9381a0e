"""synth-prompts: requests the target writes after its chat template's user header (Magpie), kept or rejected
with a reason, seeded per key, resumable, refused on other settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from spec_stats import one_thread  # noqa: F401
from test_batch import native_tiny

from treedraft import cli
from treedraft.engine import Engine, GenerationConfig
from treedraft.sampling import SamplingParams
from treedraft.training.synth import SynthConfig, SynthError, pre_query_ids, reject_reason, synthesize_prompts

pytestmark = pytest.mark.usefixtures("one_thread")
HEADER = [1, 7, 9]  # "<start> user \n" of the fake template
EOS = frozenset({60, 61, 62, 63})


@dataclass
class FakeTok:
    """A chat tokenizer over the tiny model's 64 ids: letters, a space for every id divisible by 7."""

    chat_template: str | None = "fake"
    eos_token_ids: frozenset = EOS

    def encode(self, text: str) -> list[int]:
        return [8 + ord(c) % 50 for c in text]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return HEADER + self.encode(messages[0]["content"]) + [60, 1, 11]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(" " if i % 7 == 0 else chr(97 + i % 26) for i in ids)


@dataclass
class Setup:
    engine: Engine = field(default_factory=lambda: Engine(native_tiny(seed=5)))
    tok: FakeTok = field(default_factory=FakeTok)


CFG = dict(max_new_tokens=16, temperature=1.0, seed=3, min_chars=2)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pre_query_prefix_is_the_template_up_to_the_users_text() -> None:
    assert pre_query_ids(FakeTok()) == HEADER
    with pytest.raises(SynthError, match="needs a chat model"):
        pre_query_ids(FakeTok(chat_template=None))


@pytest.mark.parametrize(
    "text,ended,why",
    [
        ("What is a good name for a cat?", True, None),
        ("What is a good name for a cat?", False, "no end of turn"),
        ("Hi?", True, "too short"),
        ("x" * 2001, True, "too long"),
        ("Tell me <|im_start|> more about it", True, "template marker"),
        ("1234 + 5678 = ??? ##### 9999", True, "mostly non-letters"),
        ("the cat " * 15, True, "repetitive"),
    ],
)
def test_reject_reasons(text: str, ended: bool, why: str | None) -> None:
    assert reject_reason(text, ended, SynthConfig()) == why


def test_requests_are_the_models_seeded_continuations_of_the_header(tmp_path: Path) -> None:
    """Every key 0..num-1 is recorded once (kept or with a reason); a kept request is exactly the text the model
    samples after the header with seed + key, cut at its end of turn; batching does not change the draws."""
    s = Setup()
    cfg = SynthConfig(num=24, **CFG)
    stats = synthesize_prompts(s.engine, s.tok, tmp_path / "p.jsonl", cfg, concurrency=5, progress=False)
    kept, rej = records(tmp_path / "p.jsonl"), records(tmp_path / "p.rejected.jsonl")
    assert sorted([r["key"] for r in kept] + [r["key"] for r in rej]) == list(range(24))
    assert stats["kept"] == len(kept) > 0 and sum(stats["rejected"].values()) == len(rej) > 0
    assert "no end of turn" in stats["rejected"]
    for r in kept:
        gc = GenerationConfig(
            max_new_tokens=16, max_tree_nodes=1, ignore_eos=True, sampling=SamplingParams(1.0, seed=3 + r["key"])
        )
        out = s.engine.generate(HEADER, gc, drafter=None).token_ids
        end = next(i for i, t in enumerate(out) if t in EOS)
        assert r["prompt"] == s.tok.decode(out[:end]).strip()
        assert r["id"] == f"synth-3-{r['key']}" and r["category"] == "synth"
    for r in rej:
        if r["reason"] == "no end of turn":
            gc = GenerationConfig(
                max_new_tokens=16, max_tree_nodes=1, ignore_eos=True, sampling=SamplingParams(1.0, seed=3 + r["key"])
            )
            assert not set(s.engine.generate(HEADER, gc, drafter=None).token_ids) & EOS
    assert [r["key"] for r in kept] == sorted(r["key"] for r in kept)  # written in key order
    synthesize_prompts(s.engine, s.tok, tmp_path / "q.jsonl", cfg, concurrency=1, progress=False)
    assert (tmp_path / "q.jsonl").read_text() == (tmp_path / "p.jsonl").read_text()  # whatever the batching


def test_duplicates_are_rejected(tmp_path: Path) -> None:
    s = Setup()
    s.tok.decode = lambda ids, skip_special_tokens=True: "the same request every time"  # type: ignore[method-assign]
    stats = synthesize_prompts(s.engine, s.tok, tmp_path / "p.jsonl", SynthConfig(num=12, **CFG), progress=False)
    assert stats["kept"] == 1 and stats["rejected"]["duplicate"] >= 1


def test_resume_continues_and_drops_a_torn_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    s = Setup()
    out = tmp_path / "p.jsonl"
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=10, **CFG), progress=False)
    first = out.read_text()
    whole = tmp_path / "whole.jsonl"
    synthesize_prompts(s.engine, s.tok, whole, SynthConfig(num=16, **CFG), progress=False)
    last = records(out)[-1]
    out.write_text(first.removesuffix(json.dumps(last) + "\n") + json.dumps(last)[:9])  # killed mid-line
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=16, **CFG), progress=False)
    assert "torn line" in capsys.readouterr().err
    got = records(out) + records(tmp_path / "p.rejected.jsonl")
    assert sorted(r["key"] for r in got) == list(range(16))  # the torn key drawn again, nothing twice
    assert out.read_text() == whole.read_text()  # as if never interrupted
    assert (tmp_path / "p.rejected.jsonl").read_text() == (tmp_path / "whole.rejected.jsonl").read_text()
    rej = tmp_path / "p.rejected.jsonl"
    rej.write_text(rej.read_text() + '{"key": 99, "rea')  # a torn rejected line too
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=16, **CFG), progress=False)
    assert "torn line" in capsys.readouterr().err and rej.read_text() == (tmp_path / "whole.rejected.jsonl").read_text()


@pytest.mark.parametrize(
    "damage,msg",
    [
        ("not json\n", "line 1 is not JSON"),
        ('{"prompt": "no key"}\n', "line 1 has no integer 'key'"),
        ("[1, 2]\n", "line 1 has no integer 'key'"),
    ],
)
def test_damaged_middle_lines_are_refused_not_dropped(tmp_path: Path, damage: str, msg: str) -> None:
    s = Setup()
    out = tmp_path / "p.jsonl"
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=8, **CFG), progress=False)
    out.write_text(damage + out.read_text())
    with pytest.raises(SynthError, match=msg):
        synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=9, **CFG), progress=False)


def test_special_tokens_inside_a_request_are_rejected(tmp_path: Path) -> None:
    """decode drops special tokens; a request holding one (a template token) is rejected, not kept without it."""
    s = Setup()
    special = set(range(1, 9))
    plain_decode = s.tok.decode

    def decode(ids, skip_special_tokens: bool = True) -> str:
        return plain_decode([i for i in ids if not (skip_special_tokens and i in special)])

    s.tok.decode = decode  # type: ignore[method-assign]
    stats = synthesize_prompts(s.engine, s.tok, tmp_path / "p.jsonl", SynthConfig(num=24, **CFG), progress=False)
    assert stats["rejected"].get("special token", 0) >= 1
    for r in records(tmp_path / "p.jsonl"):
        gc = GenerationConfig(
            max_new_tokens=16, max_tree_nodes=1, ignore_eos=True, sampling=SamplingParams(1.0, seed=3 + r["key"])
        )
        out = s.engine.generate(HEADER, gc, drafter=None).token_ids
        assert not special & set(out[: next(i for i, t in enumerate(out) if t in EOS)])


def test_other_settings_or_foreign_file_refused(tmp_path: Path) -> None:
    s = Setup()
    out = tmp_path / "p.jsonl"
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=4, **CFG), progress=False)
    with pytest.raises(SynthError, match="--temperature: 1.0 there, 0.7 now"):
        synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=4, **{**CFG, "temperature": 0.7}), progress=False)
    synthesize_prompts(s.engine, s.tok, out, SynthConfig(num=4, **CFG), progress=False,
                           load_settings={"weights": "fp32"})  # fmt: skip
    synthesize_prompts(s.engine, s.tok, tmp_path / "w.jsonl", SynthConfig(num=4, **CFG), progress=False,
                       load_settings={"weights": "int4"})  # fmt: skip
    with pytest.raises(SynthError, match="--weights: 'int4' there, 'fp32' now"):
        synthesize_prompts(s.engine, s.tok, tmp_path / "w.jsonl", SynthConfig(num=4, **CFG), progress=False,
                           load_settings={"weights": "fp32"})  # fmt: skip
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text('{"prompt": "hello"}\n')
    with pytest.raises(SynthError, match="not written by synth-prompts"):
        synthesize_prompts(s.engine, s.tok, foreign, SynthConfig(num=4, **CFG), progress=False)
    (tmp_path / "orphan.rejected.jsonl").write_text('{"key": 0, "reason": "too short"}\n')
    with pytest.raises(SynthError, match="orphan.rejected.jsonl exists but was not written"):
        synthesize_prompts(s.engine, s.tok, tmp_path / "orphan.jsonl", SynthConfig(num=4, **CFG), progress=False)
    (tmp_path / "adir").mkdir()  # a directory as --out is named as one (it read "not written by synth-prompts")
    with pytest.raises(SynthError, match="adir is a directory; give the jsonl file to write"):
        synthesize_prompts(s.engine, s.tok, tmp_path / "adir", SynthConfig(num=4, **CFG), progress=False)


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--num", "0"], "--num must be >= 1"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--top-p", "1.5"], "--top-p must be in"),
        (["--concurrency", "0"], "--concurrency must be >= 1"),
    ],
)
def test_cli_checks(tmp_path: Path, args: list[str], msg: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["synth-prompts", "--out", str(tmp_path / "p.jsonl"), *args]) == 2
    assert msg in capsys.readouterr().err

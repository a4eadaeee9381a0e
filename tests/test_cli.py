"""The command line: real generation and the bad-input paths (exit code 2 + message, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treedraft.cli", *args], capture_output=True, text=True, input=stdin, timeout=300
    )


def run_in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """``treedraft.cli.main(args)`` in this process (argument handling: no model load, no interpreter start)."""
    from treedraft.cli import main

    capsys.readouterr()
    code = main(list(args))  # an uncaught exception (a traceback for the user) fails the test right here
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture()
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model load fails the test: bad input must be reported before the slow load."""
    import treedraft

    def boom(*a, **k):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(treedraft, "load", boom)


def test_unknown_model_lists_names(capsys) -> None:
    r = run_in_process(capsys, "generate", "hi", "--model", "nope")
    assert r.returncode == 2
    assert "smollm2-135m-instruct" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("warm_cache")  # first-use measurements out of the subprocess timeout
def test_generate_prints_text_and_speed() -> None:
    r = run(
        "generate",
        "-",  # the prompt from standard input
        "--max-new-tokens",
        "16",
        "--drafter",
        "prompt-lookup",
        "--max-seq-len",
        "1024",
        stdin="What is the capital of France? Answer in one word.",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr
    assert "tokens (ended)" in r.stderr  # the answer ended (EOS) before the 16-token limit


def test_bad_limits_are_reported_cleanly_before_loading(capsys, no_model_load, tmp_path, monkeypatch) -> None:
    r = run_in_process(capsys, "generate", "hi", "--max-new-tokens", "0")
    assert r.returncode == 2 and "max_new_tokens" in r.stderr and "Traceback" not in r.stderr
    r = run_in_process(capsys, "generate", "", "--drafter", "none")
    assert r.returncode == 2 and "empty" in r.stderr
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("  \n"))  # "-": the prompt from standard input (empty here)
    r = run_in_process(capsys, "generate", "-", "--drafter", "none")
    assert r.returncode == 2 and "empty" in r.stderr
    r = run_in_process(capsys, "chat", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--repetition-penalty", "0")
    assert r.returncode == 2 and "repetition_penalty" in r.stderr and "Traceback" not in r.stderr
    r = run_in_process(capsys, "chat", "--frequency-penalty", "5")
    assert r.returncode == 2 and "frequency_penalty" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--json", "--min-tokens", "3")
    assert r.returncode == 2 and "--min-tokens cannot be combined with --json" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--json-schema", "/nonexistent/schema.json")
    assert r.returncode == 2 and "--json-schema /nonexistent/schema.json" in r.stderr
    bad = tmp_path / "s.json"
    bad.write_text('{"type": "object", "properties": {"a": {"format": "uri-reference"}}}')
    r = run_in_process(capsys, "generate", "hi", "--json-schema", str(bad))
    assert r.returncode == 2 and "'uri-reference'" in r.stderr and "Traceback" not in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--prediction", "/nonexistent/old.py")
    assert r.returncode == 2 and "--prediction /nonexistent/old.py" in r.stderr and "Traceback" not in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--regex", "ok[")
    assert r.returncode == 2 and "regex 'ok[': missing ']'" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--json", "--choice", "a")
    assert r.returncode == 2 and "give one of --json / --json-schema, --choice" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--regex", "a+", "--stop-token-id", "5")
    assert r.returncode == 2 and "--stop-token-id cannot be combined with --regex" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--min-p", "2")
    assert r.returncode == 2 and "min_p must be in [0, 1]" in r.stderr
    r = run_in_process(capsys, "generate", "hi", "--repetition-penalty", "1e-40")
    assert r.returncode == 2 and "repetition_penalty must be in [0.01, 100]" in r.stderr


def test_unknown_drafter_is_reported_before_loading(capsys, monkeypatch) -> None:
    from treedraft.models import registry

    def boom(*a, **k):
        raise AssertionError("the model was read before the bad drafter name was reported")

    monkeypatch.setattr(registry, "resolve", boom)
    monkeypatch.setattr("treedraft.api.resolve", boom)
    r = run_in_process(capsys, "generate", "hi", "--drafter", "nope")
    assert r.returncode == 2 and "unknown drafter 'nope'" in r.stderr and "prompt-lookup" in r.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("warm_cache")  # first-use measurements out of the subprocess timeout
def test_chat_keeps_the_conversation() -> None:
    r = run(
        "chat",
        "--max-new-tokens",
        "24",
        "--drafter",
        "none",
        stdin="My name is Zorblax. Remember it.\nWhat is my name?\n\n",
    )
    assert r.returncode == 0, r.stderr
    replies = r.stdout.split("> ")[1:]  # one prompt marker per turn; the input itself is not echoed
    assert len(replies) >= 2
    assert "Zorblax" in replies[1]  # only knowable from the first turn


def test_bad_suffix_max_tokens_is_reported_before_loading(capsys, monkeypatch) -> None:
    monkeypatch.setattr("treedraft.api.resolve", lambda *a: pytest.fail("model resolved before the bad flag"))
    r = run_in_process(capsys, "generate", "hi", "--drafter", "suffix", "--suffix-max-tokens", "0")
    assert r.returncode == 2 and "--suffix-max-tokens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("warm_cache")  # first-use measurements out of the subprocess timeout
def test_suffix_drafter_learns_across_runs_through_its_store(tmp_path: Path) -> None:
    import re

    args = (
        "generate",
        "Name three primary colors.",
        "--max-new-tokens",
        "24",
        "--drafter",
        "suffix",
        "--suffix-store",
        str(tmp_path / "store"),
    )
    first, second = run(*args), run(*args)  # the second process reloads what the first one recorded
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout  # drafts never change the greedy output
    mal = [float(re.search(r"mean accepted ([0-9.]+)", r.stderr).group(1)) for r in (first, second)]
    assert mal[1] > 2 * mal[0], mal
    assert (tmp_path / "store" / "log.bin").stat().st_size > 0 or (tmp_path / "store" / "snapshot.bin").exists()


def test_threads_sets_torch_and_the_native_pool(capsys, monkeypatch) -> None:
    """generate/chat --threads N: torch and the native kernels' pool both get N before the load; < 1 is refused."""
    import torch

    import treedraft
    from treedraft import kernels

    old = (torch.get_num_threads(), kernels.get_num_threads())
    seen: list[tuple[int, int]] = []

    def fake_load(*a, **k):
        seen.append((torch.get_num_threads(), kernels.get_num_threads()))
        raise ValueError("stop after the threads are set")

    monkeypatch.setattr(treedraft, "load", fake_load)
    try:
        torch.set_num_threads(2)  # not 1 before (pytest -n runs workers at 1 thread): --threads 1 must change it
        kernels.set_num_threads(2)
        for cmd in (["generate", "hi"], ["chat"]):
            r = run_in_process(capsys, *cmd, "--threads", "1")
            assert r.returncode == 2 and "stop after" in r.stderr
        want = 1 if kernels.available() else kernels.get_num_threads()
        assert seen == [(1, want), (1, want)]
        r = run_in_process(capsys, "generate", "hi", "--threads", "0")
        assert r.returncode == 2 and "--threads must be >= 1" in r.stderr and len(seen) == 2
    finally:
        torch.set_num_threads(old[0])
        kernels.set_num_threads(old[1])


def test_cli_loads_freeze_the_models_objects_out_of_the_gc(monkeypatch) -> None:
    """A full GC collection walks every live object (~335k for the default model: 75-200 ms with the GIL held, in
    the middle of a decode step); the CLI's long-lived processes freeze what the load built."""
    import argparse
    import gc

    import treedraft
    from treedraft.cli import load_from_args

    marker = [object()]
    monkeypatch.setattr(treedraft, "load", lambda *a, **k: marker)
    args = argparse.Namespace(
        model="m",
        drafter=None,
        heads=None,
        device="cpu",
        dtype=None,
        runtime=None,
        weights=None,
        kv_dtype=None,
        attn_scores="auto",
        max_seq_len=4096,
        draft_model=None,
        draft_weights="auto",
    )
    monkeypatch.setattr("treedraft.cli.suffix_kwargs", lambda a: {})
    try:
        assert load_from_args(args) is marker
        assert gc.get_freeze_count() > 0 and not any(o is marker for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is marker for o in gc.get_objects())


def test_a_missing_optional_dependency_disables_only_its_command(capsys, monkeypatch) -> None:
    """Without the server extra (fastapi), `treedraft bench` and the rest still work and `treedraft serve` says what
    to install; before, every command died in the parser's import of the server (seen on a GPU image)."""
    from treedraft.cli import build_parser, main

    for name in [m for m in sys.modules if m == "treedraft.server" or m.startswith("treedraft.server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi -> ModuleNotFoundError
    choices = build_parser()._subparsers._group_actions[0].choices
    assert {"generate", "bench", "serve", "train-heads"} <= set(choices)
    assert main(["serve", "--port", "8000", "-h"]) == 2
    err = capsys.readouterr().err
    assert "'fastapi'" in err and "pip install 'treedraft[server]'" in err
    # httpx (loadtest) and uvicorn (serve) are imported only when their command runs: checked by name
    monkeypatch.delitem(sys.modules, "fastapi")  # installed again (found by name, not imported here)
    monkeypatch.setitem(sys.modules, "httpx", None)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["loadtest", "--url", "http://127.0.0.1:9"]) == 2 and "'httpx'" in capsys.readouterr().err
    assert main(["serve"]) == 2 and "'uvicorn'" in capsys.readouterr().err


def test_bench_checks_out_warmup_and_baselines_before_loading(capsys, no_model_load, tmp_path) -> None:
    """A bench --out that cannot take the report fails before the run (it failed after the whole benchmark),
    and a negative --warmup or an unknown --baselines name is refused instead of ignored."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = ("bench", "--methods", "plain", "--num-prompts", "1", "--max-new-tokens", "4")
    r = run_in_process(capsys, *base, "--out", str(blocker / "sub"))
    assert r.returncode == 2 and f"--out {blocker / 'sub'}" in r.stderr and "Traceback" not in r.stderr
    r = run_in_process(capsys, *base, "--warmup", "-1")
    assert r.returncode == 2 and "--warmup must be >= 0" in r.stderr
    r = run_in_process(capsys, *base, "--baselines", "plain,bogus")
    assert r.returncode == 2 and "unknown --baselines bogus" in r.stderr


def test_commands_do_not_take_options_they_would_ignore(capsys) -> None:
    """train-heads / train-eagle / synth-prompts read no drafter, heads or suffix store and calibrate no drafter or
    store: those options are an argparse error there (they were listed, accepted and ignored)."""
    from treedraft.cli import build_parser

    ap = build_parser()
    for argv in (
        ["calibrate", "--drafter", "bogus"],
        ["calibrate", "--suffix-store", "d"],
        ["train-heads", "--out", "o", "--heads", "d"],
        ["train-eagle", "--drafter", "eagle"],
        ["synth-prompts", "--out", "o", "--suffix-share"],
    ):
        with pytest.raises(SystemExit):
            ap.parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err, argv
    assert ap.parse_args(["calibrate", "--heads", "d", "--kv-dtype", "float16"]).heads == "d"
    assert ap.parse_args(["generate", "hi", "--drafter", "suffix", "--suffix-store", "d"]).suffix_store == "d"


def test_os_errors_and_a_closed_pipe_end_without_a_traceback(capsys, monkeypatch, tmp_path) -> None:
    """A path that cannot be used (OSError) is an error line with exit 2; a reader that closed the pipe
    (`treedraft generate ... | head -c 10`) ends the command quietly (141, as a SIGPIPE'd tool) instead of a
    BrokenPipeError traceback."""
    import treedraft.cli as cli
    from treedraft.drafters.suffix import open_suffix_store

    def raiser(exc):
        def run(a):
            raise exc

        return run

    monkeypatch.setattr(cli, "cmd_generate", raiser(PermissionError(13, "Permission denied", "/root/x")))
    r = run_in_process(capsys, "generate", "hi")
    assert r.returncode == 2 and "Permission denied" in r.stderr
    # a real closed pipe: the command writes far more than the reader takes
    code = (
        "import sys, treedraft.cli as c\n"
        "c.cmd_generate = lambda a: [sys.stdout.write('x' * 65536) for _ in range(64)]\n"
        "sys.exit(c.main(['generate', 'hi']))"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.read(10) == b"x" * 10
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(60) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot keep the suffix store in .*a-file"):
        open_suffix_store(blocker)


def test_stats_line_says_what_cut_the_answer(capsys) -> None:
    """finish "length" is both the token limit and the context window (OpenAI's reason for both): the stats line
    tells them apart by the count."""
    from types import SimpleNamespace

    from treedraft import cli

    class FakeLLM:
        engine = SimpleNamespace(drafter=None)

        def __init__(self, n: int) -> None:
            self.n = n

        def stream(self, prompt, raw, stats, **kw):
            stats.new_tokens = self.n
            yield SimpleNamespace(text="x" * self.n, finish_reason="length")

    for n, said in ((30, "30 tokens (cut at the token limit)"), (7, "7 tokens (cut at the context window")):
        assert cli._run_stream(FakeLLM(n), "p", {"max_new_tokens": 30}, raw=True) == "x" * n
        assert said in capsys.readouterr().err


def test_chat_history_drops_its_oldest_exchanges_to_fit_the_window() -> None:
    from treedraft.cli import fit_history

    def words(m: list[dict]) -> int:
        return sum(len(x["content"].split()) for x in m)

    sys_, turns = {"role": "system", "content": "be brief"}, []
    for i in range(3):
        turns += [
            {"role": "user", "content": f"question {i} " * 5},
            {"role": "assistant", "content": f"answer {i} " * 5},
        ]
    msgs = [sys_, *turns, {"role": "user", "content": "and now?"}]  # 2 + 60 + 2 words
    assert fit_history(msgs, 1, words, 64) == 0 and len(msgs) == 8  # fits: nothing dropped
    assert fit_history(msgs, 1, words, 50) == 2  # the oldest exchange goes, the system prompt stays
    assert msgs[0] is sys_ and msgs[1]["content"].startswith("question 1") and words(msgs) == 44
    assert fit_history(msgs, 1, words, 3) == 4 and msgs == [sys_, {"role": "user", "content": "and now?"}]
    assert fit_history(msgs, 1, words, 1) == 0  # the last message is never dropped (the engine reports it)
    lone = [{"role": "assistant", "content": "x " * 9}, {"role": "user", "content": "y"}]
    assert fit_history(lone, 0, words, 5) == 1 and lone == [{"role": "user", "content": "y"}]


def test_generate_reads_the_prompt_from_stdin_without_its_final_newline(capsys, monkeypatch) -> None:
    """`echo q | treedraft generate -` asks what `treedraft generate q` asks (the newline echo adds is not part of it)."""
    import io

    from treedraft import cli

    seen = []

    def stop(a):  # the prompt as it reaches the load; then a user error ends the command
        seen.append(a.prompt)
        raise ValueError("stop here")

    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hi\n\n"))
    monkeypatch.setattr(cli, "load_from_args", stop)
    r = run_in_process(capsys, "generate", "-")
    assert r.returncode == 2 and "stop here" in r.stderr and seen == ["Say hi"]


def test_sampling_flags_at_temperature_zero_are_named_not_silently_ignored(capsys, monkeypatch) -> None:
    from treedraft import cli

    def stop(a):
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "load_from_args", stop)
    r = run_in_process(capsys, "generate", "hi", "--top-k", "5", "--seed", "3", "--rule", "typical")
    assert r.returncode == 2 and "note: --top-k, --seed, --rule typical only shape sampling" in r.stderr
    for quiet in (["--temperature", "0.7", "--top-k", "5", "--seed", "3"], []):
        r = run_in_process(capsys, "generate", "hi", *quiet)
        assert r.returncode == 2 and "note:" not in r.stderr


def test_chat_refuses_a_message_too_long_alone_and_keeps_the_conversation(capsys, monkeypatch) -> None:
    """A message that cannot fit the window even alone is refused with its size, and the earlier turns stay (they
    were all dropped to make room for it, then the message failed too)."""
    import io
    from types import SimpleNamespace

    from treedraft import cli
    from treedraft.text import Chunk

    prompts: list[list[dict]] = []

    class FakeLLM:
        tokenizer = SimpleNamespace(is_chat=True)
        model = SimpleNamespace(max_seq_len=40)
        engine = SimpleNamespace(drafter=None)

        def encode_prompt(self, messages):
            return [0] * sum(len(m["content"].split()) + 1 for m in messages)

        def stream(self, messages, **kw):
            prompts.append([m["content"] for m in messages])
            yield Chunk(text="ok", token_ids=[1], finish_reason="stop")

    monkeypatch.setattr(cli, "load_from_args", lambda a: FakeLLM())
    words = " ".join(["w"] * 60)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"first\n{words}\nsecond\n\n"))
    r = run_in_process(capsys, "chat", "--max-new-tokens", "4")
    assert r.returncode == 0 and "this message alone takes 61 of the window's 40 tokens" in r.stderr
    assert prompts == [["first"], ["first", "ok", "second"]]  # the long one never ran; the first turn was kept


def test_notes_after_load_say_what_the_model_or_drafter_makes_of_the_flags(capsys) -> None:
    """A model without a chat template takes the prompt raw (generate did so silently while chat refused); --prediction
    with a drafter that does not search it, and --max-tree-nodes with plain decoding, change nothing: each is said."""
    from argparse import Namespace
    from types import SimpleNamespace

    from treedraft.cli import notes_after_load

    def llm(chat: bool, drafter: str | None):
        return SimpleNamespace(
            model_name="m",
            tokenizer=SimpleNamespace(is_chat=chat),
            engine=SimpleNamespace(drafter=None if drafter is None else SimpleNamespace(name=drafter)),
        )

    def notes(a: Namespace, model) -> str:
        notes_after_load(a, model)
        return capsys.readouterr().err

    quiet = Namespace(raw=False, prediction=None, max_tree_nodes=64)
    assert notes(quiet, llm(True, "hybrid-suffix")) == ""
    assert "has no chat template: the prompt is used as raw text" in notes(quiet, llm(False, "prompt-lookup"))
    assert notes(Namespace(raw=True, prediction=None, max_tree_nodes=64), llm(False, "prompt-lookup")) == ""
    pred = Namespace(raw=False, prediction="old.py", max_tree_nodes=64)
    for name in ("medusa", "eagle", "draft-model", None):
        assert "--prediction is searched by the drafters" in notes(pred, llm(True, name)), name
    for name in ("prompt-lookup", "hybrid-suffix", "hybrid-draft", "suffix"):
        assert notes(pred, llm(True, name)) == "", name
    nodes = Namespace(raw=False, prediction=None, max_tree_nodes=16, heads="h", suffix_share=True)
    assert "--max-tree-nodes, --heads, --suffix-share: plain decoding (drafter none)" in notes(nodes, llm(True, None))
    assert notes(nodes, llm(True, "medusa")) == ""  # (load() warns about those a loaded drafter does not read)

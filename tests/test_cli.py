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


def test_unknown_model_lists_names() -> None:
    r = run("generate", "hi", "--model", "nope")
    assert r.returncode == 2
    assert "smollm2-135m-instruct" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_generate_prints_text_and_speed() -> None:
    r = run(
        "generate",
        "What is the capital of France? Answer in one word.",
        "--max-new-tokens",
        "16",
        "--drafter",
        "prompt-lookup",
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


@pytest.mark.slow
def test_bad_limits_are_reported_cleanly() -> None:
    r = run("generate", "hi", "--max-new-tokens", "0")
    assert r.returncode == 2 and "max_new_tokens" in r.stderr and "Traceback" not in r.stderr
    r = run("generate", "", "--drafter", "none")
    assert r.returncode == 2 and "empty" in r.stderr


@pytest.mark.slow
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


def test_bad_suffix_max_tokens_is_reported_before_loading() -> None:
    r = run("generate", "hi", "--drafter", "suffix", "--suffix-max-tokens", "0")
    assert r.returncode == 2 and "--suffix-max-tokens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
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

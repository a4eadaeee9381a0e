"""Prompt files: the one jsonl reader used by `bench`, `train-heads` and `calibrate`.

Each non-empty line is a JSON object holding one prompt, the first user turn of:

- ``{"prompt": "..."}``;
- ``{"turns": ["...", ...]}`` (MT-Bench / Spec-Bench questions);
- ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (ShareGPT);
- ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (OpenAI-style chat).

Ids come from ``question_id`` or ``id`` (else the line number), categories from
``category`` (else ``general``). Also where the shared data files live.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHARED_DATA = Path("..") / "shared" / "data"  # relative to the working directory or the repository root
MT_BENCH_FILE = "mt_bench_questions.jsonl"
SHAREGPT_FILE = "sharegpt_prompts.jsonl"
FORMATS = (
    "'prompt' string, 'turns' list, ShareGPT 'conversations' list ({'from': 'human', 'value': ...}) "
    "or 'messages' list ({'role': 'user', 'content': ...})"
)

_USER_FROM = ("human", "user")


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file, the line and what is expected."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: the first user turn of a record."""

    id: str
    category: str
    text: str


def _first_user_turn(turns: Any, who: str, what: str) -> str | None:
    """First turn whose speaker key ``who`` is human/user; its ``what`` text. None if there is none."""
    for t in turns:
        if isinstance(t, dict) and str(t.get(who, "")).lower() in _USER_FROM:
            return t.get(what)
    return None


def prompt_text(row: Any, where: str) -> str:
    """The prompt text of one decoded record; ``where`` ("file:line") prefixes errors."""
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if "prompt" in row:
        text, key = row["prompt"], "'prompt'"
    elif "turns" in row:
        turns = row["turns"]
        text, key = (turns[0] if isinstance(turns, list) and turns else None), "'turns' (first turn)"
    elif "conversations" in row:
        conv = row["conversations"]
        if not isinstance(conv, list):
            raise PromptFileError(f"{where}: 'conversations' must be a list of {{'from', 'value'}} objects")
        text, key = _first_user_turn(conv, "from", "value"), "'conversations' (first 'from': 'human' turn's 'value')"
    elif "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list):
            raise PromptFileError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
        text, key = _first_user_turn(msgs, "role", "content"), "'messages' (first 'role': 'user' message's 'content')"
    else:
        raise PromptFileError(f"{where}: no prompt found; expected a {FORMATS}")
    if not isinstance(text, str) or not text.strip():
        raise PromptFileError(f"{where}: {key} must be a non-empty string; expected a {FORMATS}")
    return text


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """All prompts of a jsonl file, in file order; raises PromptFileError with file:line on bad records."""
    path = Path(path)
    if path.is_dir():
        raise PromptFileError(f"{path} is a directory; expected a jsonl prompt file")
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist")
    out: list[Prompt] = []
    with open(path, "rb") as f:  # lines decoded one by one: a line that is not UTF-8 is named by its number
        for n, raw in enumerate(f, 1):
            try:  # (utf-8-sig on line 1: a byte-order mark some editors write is not a bad first line)
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise PromptFileError(
                    f"{path}:{n}: not UTF-8 text ({e.reason} at byte {e.start} of the line); save the file as UTF-8 "
                    "(JSON Lines are UTF-8)"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            text = prompt_text(row, f"{path}:{n}")
            out.append(
                Prompt(str(row.get("question_id", row.get("id", n))), str(row.get("category") or "general"), text)
            )
    if not out:
        raise PromptFileError(f"prompt file {path} has no prompts")
    return out


def find_shared_data(name: str) -> Path | None:
    """``../shared/data/<name>`` relative to the working directory or the repository root, if present."""
    repo = Path(__file__).resolve().parents[2]
    for base in (Path.cwd(), repo):
        p = (base / SHARED_DATA / name).resolve()
        if p.is_file():
            return p
    return None


def first_prompts(items: list, n: int | None, path: str | Path, warn: bool = True) -> list:
    """The first ``n`` of ``items`` (None: all), saying so on stderr when the file has fewer than ``n`` (the run uses
    them all; a silently smaller run was mistaken for the one asked) and ``warn`` (the user gave ``n``)."""
    import sys

    if warn and n is not None and n > len(items):
        print(
            f"warning: --num-prompts {n}, but {path} has {len(items)} prompts: using all {len(items)}", file=sys.stderr
        )
    return list(items[:n])

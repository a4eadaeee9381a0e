"""Structured outputs side by side: plain decoding and the default drafter (a fresh copy per run) under a pydantic
JSON Schema (``--mode schema``: MT-Bench first turns answered as {title, points, summary}) or as tool calls
(``--mode tools``: short requests for four tools, tool_choice required). Decode speed, mean accepted length,
outputs checked against plain, answers that validate as the model. Runs of a prompt alternate their order.

    python benchmarks/schema_ab.py --mode schema --prompts 20 --tokens 256
    python benchmarks/schema_ab.py --mode tools
    python benchmarks/schema_ab.py --mode rich --prompts 20 --tokens 256

``--mode rich``: the same first turns answered as a ``Review`` (numeric bounds and a step, a tuple, an HttpUrl, a
discriminated union, a Literal-keyed dict, a date, a pattern with a length bound).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path
from typing import Literal

import pydantic

import treedraft
from treedraft.drafters.hybrid import fresh_copy


class Answer(pydantic.BaseModel):
    title: str
    points: list[str] = pydantic.Field(max_length=5)
    summary: str


class Good(pydantic.BaseModel):
    kind: Literal["good"]
    why: str


class Bad(pydantic.BaseModel):
    kind: Literal["bad"]
    risk: int = pydantic.Field(ge=1, le=5)


class Review(pydantic.BaseModel):
    """What session 27's schema keywords let a model be: bounds, a step, a tuple, a URL, a discriminated union, a
    dict keyed by a Literal, a date and a bounded pattern."""

    title: str = pydantic.Field(max_length=80)
    rating: int = pydantic.Field(ge=1, le=10)
    confidence: float = pydantic.Field(ge=0, le=1, multiple_of=0.05)
    span: tuple[int, int]
    source: pydantic.HttpUrl
    verdict: Good | Bad = pydantic.Field(discriminator="kind")
    effort: dict[Literal["easy", "hard"], int] = {}
    day: datetime.date
    code: str = pydantic.Field(pattern="^[A-Z]{2}-[0-9]{3}$", max_length=80)


def tool(name: str, desc: str, props: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": params}}


TOOLS = [
    tool(
        "get_weather",
        "Current weather in a city.",
        {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),  # fmt: skip
    tool("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
    tool("search_web", "Search the web.", {"query": {"type": "string"}}, ["query"]),
    tool(
        "send_email",
        "Send an email.",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        ["to", "subject", "body"],
    ),  # fmt: skip
]
ASKS = [
    "What is the weather in Paris right now?",
    "How warm is it in Tokyo today, in fahrenheit?",
    "Add 17 and 25.",
    "What is 1200 plus 345?",
    "Search the web for the history of the Eiffel Tower.",
    "Find recent news about electric cars.",
    "Email alice@example.com that the meeting moves to Friday at 10.",
    "Send bob@example.com a thank-you note for the birthday gift.",
    "Is it raining in London?",
    "Look up the best pizza recipe online.",
    "Add 3 and 4, please.",
    "Write to carol@example.com asking for the quarterly report.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("schema", "tools", "rich"), default="schema")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench_questions.jsonl"))
    a = ap.parse_args()
    llm = treedraft.load()
    model = Review if a.mode == "rich" else Answer
    if a.mode in ("schema", "rich"):
        fmt = {"type": "json_schema", "json_schema": {"schema": model.model_json_schema()}}
        asks = [json.loads(line)["turns"][0] for line in open(a.data)][: a.prompts]
        ask = (
            "Answer as JSON with a title, up to five points and a summary."
            if a.mode == "schema"
            else "Review this request as JSON: a title, a rating, your confidence, a span, a source URL, a verdict, "
            "the effort, a date and a code."
        )
        asks = [q + "\n\n" + ask for q in asks]
        kw = {"response_format": fmt, "max_new_tokens": a.tokens}
    else:
        asks = ASKS[: a.prompts]
        kw = {"tools": TOOLS, "tool_choice": "required", "max_new_tokens": a.tokens}
    llm.generate("Say hi.", **(kw | {"max_new_tokens": 8}))  # warm-up: builds the automaton
    tok, sec, acc = {"plain": 0, "default": 0}, {"plain": 0.0, "default": 0.0}, {"plain": [], "default": []}
    same = valid = 0
    for i, q in enumerate(asks):
        res = {}
        for k in ("plain", "default") if i % 2 == 0 else ("default", "plain"):
            drafter = None if k == "plain" else fresh_copy(llm.get_drafter("default"))
            res[k] = r = llm.generate([{"role": "user", "content": q}], drafter=drafter, **kw)
            tok[k] += r.stats.new_tokens
            sec[k] += r.stats.t_decode
            acc[k].append(r.stats.mean_accepted_length)
        p = res["plain"]
        same += p.token_ids == res["default"].token_ids
        try:
            if a.mode in ("schema", "rich"):
                valid += p.finish_reason == "stop" and bool(model.model_validate_json(p.text))
            else:
                valid += p.finish_reason == "tool_calls" and bool(json.loads(p.tool_calls[0]["function"]["arguments"]))
        except (ValueError, TypeError):
            pass
        what = p.text[:70] if a.mode != "tools" else json.dumps(p.tool_calls)[:160] if p.tool_calls else p.text[:70]
        print(f"{i}: {p.stats.new_tokens} tokens, {p.finish_reason}: {what!r}", flush=True)
    rate = {k: tok[k] / sec[k] for k in tok}
    print(f"\ncpu: {platform.processor() or platform.machine()}; mode {a.mode}; {len(asks)} prompts x {a.tokens}")
    for k in ("plain", "default"):
        print(f"{k}: {rate[k]:.1f} tok/s, mean accepted {sum(acc[k]) / len(acc[k]):.2f}")
    print(f"default / plain: {rate['default'] / rate['plain']:.3f}x; output = plain {same}/{len(asks)}; "
          f"answers valid {valid}/{len(asks)}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Tool calling (OpenAI's ``tools`` / ``tool_choice``) for any model, its chat template aware of tools or not.

The tools are described in the system message, and the answer is constrained (JSON Schema mode,
:mod:`treedraft.grammar`) to one JSON object with exactly one key: a tool's name, whose value is that tool's
arguments, valid under its ``parameters`` schema; with ``tool_choice`` "auto", the key ``"response"`` holding a
plain answer is the other choice. So a call always names a declared tool with valid arguments, and speculative
decoding stays exact as in JSON mode. llama.cpp's "generic" tool-call format makes the same choice for models
without a tool template; this one is shorter (the tool's name is the key).
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RESPONSE_KEY = "response"
NAMED = "fn:"  # a named tool_choice's mode: this + the name (":" is in no tool name, so no name reads as a mode)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


def parse_tools(tools: Sequence[Any]) -> list[Tool]:
    """OpenAI's ``tools`` list (``{"type": "function", "function": {"name", "description", "parameters"}}``) as
    :class:`Tool` s; ValueError naming what is wrong (the schemas are checked when the grammar compiles)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {...}}")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}")
        if any(x.name == name for x in out):
            raise ValueError(f"tools[{i}]: a second tool named {name!r}")
        desc = f.get("description") or ""
        params = f.get("parameters", _NO_ARGS)
        if not isinstance(desc, str) or not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"tools[{i}].function: description must be a string and parameters a JSON Schema of "
                             "type object")  # fmt: skip
        out.append(Tool(name, desc, params))
    return out


def tool_mode(tool_choice: Any, tools: Sequence[Tool]) -> str | None:
    """``tool_choice`` as a mode: "auto" (the default with tools), "required", ``NAMED`` + a tool's name (that tool
    must be called), or None ("none": answer without tools)."""
    if tool_choice is None or tool_choice == "auto":
        return "auto" if tools else None
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return "required"
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(f, dict):
        name = f.get("name")
        if not any(t.name == name for t in tools):
            raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        return NAMED + str(name)
    raise ValueError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}, "
        f"got {tool_choice!r}"
    )


def _offered(tools: Sequence[Tool], mode: str) -> list[Tool]:
    return list(tools) if mode in ("auto", "required") else [t for t in tools if NAMED + t.name == mode]


def _moved_refs(sch: Any, base: str) -> Any:
    """``sch`` with its local ``$ref`` s rebased under ``base`` (its place in the combined schema)."""
    if isinstance(sch, dict):
        out = {}
        for k, v in sch.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = base + v[1:]
            else:
                out[k] = _moved_refs(v, base)
        return out
    if isinstance(sch, list):
        return [_moved_refs(v, base) for v in sch]
    return sch


def _object_args(params: dict) -> dict:
    """A tool's parameters as the schema of a JSON *object*: ``{}`` or one without ``type`` (read as type object when the
    tools were parsed) let the grammar write any JSON value as the arguments (a review: ``{"f": 5}`` gave arguments
    5; OpenAI's are always an object)."""
    return params if "type" in params else {**params, "type": "object"}


def answer_schema(tools: Sequence[Tool], mode: str) -> dict:
    """The JSON Schema of the answer: an object with exactly one key, a tool's name (its value: the arguments)
    or, with "auto", ``"response"`` (a string). Each tool's parameters sit in ``$defs`` with their references
    rebased, so ``#/$defs/...`` inside them still resolve."""
    offered = _offered(tools, mode)
    if mode == "auto" and any(t.name == RESPONSE_KEY for t in offered):
        raise ValueError(f"a tool named {RESPONSE_KEY!r} clashes with tool_choice 'auto''s answer key; rename it")
    defs = {
        f"tool{i}": _object_args(_moved_refs(copy.deepcopy(t.parameters), f"#/$defs/tool{i}"))
        for i, t in enumerate(offered)
    }
    props: dict[str, Any] = {RESPONSE_KEY: {"type": "string"}} if mode == "auto" else {}
    props |= {t.name: {"$ref": f"#/$defs/tool{i}"} for i, t in enumerate(offered)}
    return {
        "type": "object",
        "properties": props,
        "minProperties": 1,
        "maxProperties": 1,
        "additionalProperties": False,
        "$defs": defs,
    }


class ToolRequestError(ValueError):
    """A request parameter that cannot go with tools; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def answer_format(tools: Sequence[Tool], mode: str, stop: Sequence[str] = (), response_format: Any = None) -> dict:
    """The ``response_format`` that constrains a tool answer (:func:`answer_schema`). ToolRequestError for a
    ``response_format`` of its own (the answer's form is the call's) or stop strings (one could cut the call);
    ValueError where the tools' schemas cannot make one."""
    if response_format is not None:
        raise ToolRequestError("response_format cannot be combined with tools (the answer's form is the tool call's); "
                               "drop one, or set tool_choice 'none'", "response_format")  # fmt: skip
    if stop:
        raise ToolRequestError("stop cannot be combined with tools (a stop string could cut the call); drop stop, or "
                               "set tool_choice 'none'", "stop")  # fmt: skip
    return {"type": "json_schema", "json_schema": {"schema": answer_schema(tools, mode)}}


def system_text(tools: Sequence[Tool], mode: str) -> str:
    """What the model is told about the tools and the answer's form."""
    lines = ["You can call these tools (their arguments as JSON Schema):"]
    for t in _offered(tools, mode):
        desc = f" {t.description.strip()}" if t.description.strip() else ""
        lines.append(f"- {t.name}:{desc} Arguments: {json.dumps(t.parameters, ensure_ascii=False)}")
    call = '{"<tool name>": {<arguments>}}'
    if mode == "auto":
        lines.append(f'To call a tool, answer with only {call}. To answer directly, answer {{"{RESPONSE_KEY}": '
                     '"<your answer>"}.')  # fmt: skip
    elif mode == "required":
        lines.append(f"Answer with only {call}, calling one of them.")
    else:
        name = mode.removeprefix(NAMED)
        lines.append(f'Answer with only {{"{name}": {{<arguments>}}}}, calling {name}.')
    return "\n".join(lines)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_dicts(messages: Sequence[Any]) -> list[dict]:
    """OpenAI chat messages as :func:`render_messages` reads them, read as the server reads a request's: a role of
    :data:`CHAT_ROLES` (developer is a system message), content a string or a list of ``{"type": "text", "text"}``
    parts (joined), null only in an assistant message with ``tool_calls`` (each ``{"function": {"name",
    "arguments"}}``); ValueError naming the message and what to change otherwise."""
    out = []
    for i, m in enumerate(messages):
        where = f"message {i}"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: each message is a dict with 'role' and 'content', got {type(m).__name__}")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}: role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if calls is not None:
            ok = role == "assistant" and isinstance(calls, list)
            ok = ok and all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                for c in calls
            )  # fmt: skip
            if not ok:
                raise ValueError(
                    f"{where}: tool_calls belong to an assistant message, as a list of "
                    '{"function": {"name": ..., "arguments": ...}}'
                )
        if isinstance(content, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise ValueError(f'{where}: content parts must be {{"type": "text", "text": "..."}} (only text parts)')
            content = "".join(p["text"] for p in content)
        elif content is None and not calls:
            raise ValueError(f"{where}: content is required (null only in an assistant message with tool_calls)")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
        d: dict = {"role": "system" if role == "developer" else role, "content": content or ""}
        if calls:
            d["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            d["tool_call_id"] = m["tool_call_id"]
        out.append(d)
    return out


def render_messages(messages: list[dict], tools: Sequence[Tool], mode: str | None) -> list[dict]:
    """Chat messages for a template that knows no tools: the tools' description joined to the system message (or
    a new one first), an assistant's earlier tool calls as the JSON it would have written, and tool results as user
    turns naming the call they answer. Where the answer is free text (``mode`` None: tool_choice "none", or no
    tools) a call is told with its result instead ("get_weather was called with {...} and returned: ..."): replayed
    as the assistant's JSON, the model copied that JSON as its answer after the result (a review, SmolLM2)."""
    names: dict[str, str] = {}
    args: dict[str, str] = {}  # mode None: a call's arguments, told with its result
    out: list[dict] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            for c in calls:
                names[c.get("id", "")] = c["function"]["name"]
            if mode is None:  # the calls are told with their results (below); only the turn's own text stays
                for c in calls:
                    args[c.get("id", "")] = json.dumps(_arguments(c), ensure_ascii=False)
                if (m.get("content") or "").strip():
                    out.append({"role": "assistant", "content": m["content"].strip()})
                continue
            text = "\n".join(json.dumps({c["function"]["name"]: _arguments(c)}, ensure_ascii=False) for c in calls)
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
        elif m["role"] == "tool":  # consecutive results make one user turn (templates may want roles to alternate)
            cid = m.get("tool_call_id") or ""
            who = names.get(cid)
            if cid in args:
                line = f"{who} was called with {args[cid]} and returned: {m.get('content') or ''}"
            else:
                line = f"{f'Result of {who}' if who else 'Tool result'} (call {cid}): {m.get('content') or ''}"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "tool_result": True})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if mode is not None:
        text = system_text(tools, mode)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}".strip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(call: dict) -> Any:
    args = call["function"].get("arguments") or "{}"
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args  # as the client sent it


_RESPONSE_START = re.compile(r'\s*\{\s*"' + RESPONSE_KEY + r'"\s*:\s*"')
# the answer's first key, once its quote closes (a tool's name, or "response"), and the colon after it if written yet
_FIRST_KEY = re.compile(r'\s*\{\s*"((?:[^"\\]|\\.)*)"\s*(?::\s*)?')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


class ResponseText:
    """The text of an "auto" answer's ``"response"`` as the JSON arrives, so a stream can send it as it is written:
    :meth:`feed` takes the answer's next text and returns the string's newly complete characters (an escape is held
    until whole; a surrogate pair's first half until its second). ``mode``: "undecided" until the key is known,
    then "response" (its characters stream) or "call" (a tool's name: nothing streams)."""

    def __init__(self) -> None:
        self.text = ""
        self.mode = "undecided"
        self.done = 0  # where the value's undecoded characters start
        self.closed = False

    def feed(self, more: str) -> str:
        self.text += more
        if self.mode == "undecided":
            m = _RESPONSE_START.match(self.text)
            if m is not None:
                self.mode, self.done = "response", m.end()
            else:
                key = _FIRST_KEY.match(self.text)
                if key is not None and key.group(1) != RESPONSE_KEY:
                    self.mode = "call"  # a tool's name
        if self.mode != "response" or self.closed:
            return ""
        i, cut = self.done, self.done
        while i < len(self.text):
            c = self.text[i]
            if c == '"':
                self.closed = True
                break
            if c == "\\":
                n = 6 if self.text[i + 1 : i + 2] == "u" else 2
                if i + n > len(self.text):
                    break
                i += n
                if n == 6 and _HIGH_SURROGATE.search(self.text[:i]) and i + 6 > len(self.text):
                    break  # a pair's first half: wait for the second
            else:
                i += 1
            cut = i
        out = json.loads('"' + self.text[self.done : cut] + '"') if cut > self.done else ""
        self.done = cut
        return out


def _complete(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and len(obj) == 1


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _cut_answer(text: str, mode: str) -> dict:
    """The assistant message of an answer the token budget cut (as OpenAI returns one, finish reason "length"): a
    ``"response"`` 's text so far; a call whose tool name is known, with its arguments' JSON text so far (incomplete);
    before either is known, empty content. The answer's JSON wrapper is never the content."""
    part = ResponseText()
    said = part.feed(text)
    if mode == "auto" and part.mode == "response":
        return {"role": "assistant", "content": said}
    key = _FIRST_KEY.match(text)
    name = mode.removeprefix(NAMED) if mode.startswith(NAMED) else None
    if key is not None and not (mode == "auto" and key.group(1) == RESPONSE_KEY):  # (a response before its quote)
        # the grammar closes a key only on a declared tool's name
        return {"role": "assistant", "content": None, "tool_calls": [_call(json.loads(f'"{key.group(1)}"'),
                                                                            text[key.end() :])]}  # fmt: skip
    if name is not None:  # a named call: the tool is known before its key is written
        return {"role": "assistant", "content": None, "tool_calls": [_call(name, "")]}
    return {"role": "assistant", "content": ""}


def answer_message(text: str, finish_reason: str, mode: str) -> tuple[dict, str]:
    """The assistant message and finish reason for a constrained answer: a tool call (``tool_calls``, finish
    reason "tool_calls") or, for ``"response"``, its text. An answer cut by the token budget keeps finish reason
    "length" and is what was written so far (:func:`_cut_answer`: a call's arguments are then incomplete JSON)."""
    if finish_reason != "stop" and _complete(text):
        finish_reason = "stop"  # the budget ended right at the closing brace: the answer is whole
    if finish_reason != "stop":
        return _cut_answer(text, mode), finish_reason
    obj = json.loads(text)
    ((key, value),) = obj.items()  # the grammar allows exactly one key
    if mode == "auto" and key == RESPONSE_KEY:
        return {"role": "assistant", "content": value}, "stop"
    # the model's own JSON text of the arguments, not a re-encoding of the parsed value (1e400 came back as Infinity,
    # not JSON; long numbers lost digits; repeated keys merged)
    m = _FIRST_KEY.match(text)  # (the grammar wrote {"name": <arguments>}: the pattern eats the colon and spaces)
    assert m is not None
    end = json.JSONDecoder().raw_decode(text, m.end())[1]
    call = _call(key, text[m.end() : end])
    return {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
